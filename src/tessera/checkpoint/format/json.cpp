// Strict JSON reading (json.h): nlohmann's parser driven through a SAX handler that
// refuses duplicate keys and stops at an item bound.
#include "tessera/checkpoint/format/json.h"

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "tessera/core/error.h"
#include "tessera/core/strings.h"

namespace tessera::checkpoint {

using json = nlohmann::json;

namespace {

// Builds the DOM of a JSON text like nlohmann's parser, and notes the first key that
// appears twice in one object (a map lookup in the object being built: no set of keys
// aside). A SAX handler rather than json::parse's callback, which costs several times the
// parse itself (bench/scale: 82 of the 102 ms that planning a load of a Llama-3-70B
// checkpoint took went to the callback).
class StrictDom : public nlohmann::json_sax<json> {
 public:
  StrictDom(json& root, const std::string& what, uint64_t max_items)
      : root_(root), what_(what), max_items_(max_items) {}
  std::string duplicate, place;

  bool null() override { return put(nullptr); }
  bool boolean(bool v) override { return put(v); }
  bool number_integer(number_integer_t v) override { return put(v); }
  bool number_unsigned(number_unsigned_t v) override { return put(v); }
  bool number_float(number_float_t v, const string_t&) override { return put(v); }
  bool string(string_t& v) override { return put(std::move(v)); }
  bool binary(binary_t& v) override { return put(json::binary(std::move(v))); }
  bool start_object(std::size_t) override { return open(json::object(), true); }
  bool start_array(std::size_t) override { return open(json::array(), false); }
  bool end_object() override { return close(); }
  bool end_array() override { return close(); }
  bool key(string_t& k) override {
    count();
    Frame& f = stack_.back();
    if (duplicate.empty() && f.value->contains(k)) {
      duplicate = k;
      for (size_t i = 0; i + 1 < stack_.size(); ++i)
        place += stack_[i].object ? concat(place.empty() ? "" : " > ", "'", stack_[i].last, "'") : "[]";
    }
    f.slot = &(*f.value)[k];
    f.last = std::move(k);
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::json::exception& ex) override {
    throw Error(concat(what_, " is not valid JSON: ", ex.what()));
  }

 private:
  struct Frame {
    json* value;
    bool object;
    json* slot = nullptr;  // an object's member named by the last key
    std::string last;      // that key (the name of a nested value, for the message)
  };
  // Where the next value goes: the root, the end of the open array, or the open object's slot.
  json* place_value(json&& v) {
    count();
    if (stack_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Frame& f = stack_.back();
    if (!f.object) {
      f.value->push_back(std::move(v));
      return &f.value->back();
    }
    *f.slot = std::move(v);
    return f.slot;
  }
  bool put(json&& v) {
    place_value(std::move(v));
    return true;
  }
  bool open(json&& v, bool object) {
    json* p = place_value(std::move(v));
    stack_.push_back({p, object, nullptr, {}});
    return true;
  }
  bool close() {
    stack_.pop_back();
    return true;
  }
  // One more value or member name; past max_items_ (when set) the parse stops before
  // storing it, so the document never costs more than the bound.
  void count() {
    if (max_items_ != 0 && ++items_ > max_items_)
      throw Error(concat(what_, " holds more than ", max_items_,
                         " JSON values and keys, the bound every reader enforces (corrupt or hostile)"));
  }
  json& root_;
  const std::string& what_;
  uint64_t max_items_, items_ = 0;
  std::vector<Frame> stack_;
};

// Counts values and member names, storing nothing.
struct ItemCounter : nlohmann::json_sax<json> {
  uint64_t n = 0;
  bool one() {
    ++n;
    return true;
  }
  bool null() override { return one(); }
  bool boolean(bool) override { return one(); }
  bool number_integer(number_integer_t) override { return one(); }
  bool number_unsigned(number_unsigned_t) override { return one(); }
  bool number_float(number_float_t, const string_t&) override { return one(); }
  bool string(string_t&) override { return one(); }
  bool binary(binary_t&) override { return one(); }
  bool start_object(std::size_t) override { return one(); }
  bool start_array(std::size_t) override { return one(); }
  bool end_object() override { return true; }
  bool end_array() override { return true; }
  bool key(string_t&) override { return one(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::json::exception& ex) override {
    throw Error(concat("internal: metadata text is not valid JSON: ", ex.what()));
  }
};

}  // namespace

uint64_t count_json_items(const std::string& text) {
  ItemCounter c;
  json::sax_parse(text, &c);
  return c.n;
}

json parse_json_bounded(const std::string& text, const std::string& what, uint64_t max_items) {
  json j;
  StrictDom dom(j, what, max_items);
  try {
    json::sax_parse(text, &dom);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(concat(what, " is not valid JSON: ", e.what()));
  }
  TESSERA_CHECK(dom.duplicate.empty(), what, ": duplicate key '", dom.duplicate, "' in ",
                dom.place.empty() ? std::string("the top-level object") : "the object at " + dom.place,
                " (edited or corrupt; a key may appear once)");
  return j;
}

json parse_json_strict(const std::string& text, const std::string& what) { return parse_json_bounded(text, what, 0); }

}  // namespace tessera::checkpoint
