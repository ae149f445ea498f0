// Reading JSON strictly, as every reader of checkpoint metadata and safetensors headers
// does: a key twice in one object is refused, and so is a text of more items than a bound.
// Python: tessera_ckpt/_format_json.py.
#pragma once
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>

namespace tessera::checkpoint {

// Parses JSON text like nlohmann::json::parse, but refuses a key that appears twice in
// one object, at any depth (nlohmann would keep the last one silently): a tampered
// file could otherwise show one value to a reviewer and load another. Errors start
// with `what` and name the key and where it is.
nlohmann::json parse_json_strict(const std::string& text, const std::string& what);

// parse_json_strict, refusing a text of more than `max_items` values and member names (0: no
// bound) before storing the one past the bound.
nlohmann::json parse_json_bounded(const std::string& text, const std::string& what, uint64_t max_items);

// The number of JSON values and member names in valid JSON `text`, counted without building it.
uint64_t count_json_items(const std::string& text);

}  // namespace tessera::checkpoint
