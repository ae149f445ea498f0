// A rendezvous store that asks for a shared token (internal to the distributed layer; used
// by rendezvous.cpp for rank 0's store and by launch/rounds.cpp for the launchers' store).
//
// c10d's TCPStore answers any client that connects, and its client cannot present a
// credential. When the job has a token (rendezvous_token()), the store is therefore split:
//
//   rank or launcher --c10d--> StoreRelay (127.0.0.1, this process) ==proof==> StoreGate
//   (MASTER_ADDR:MASTER_PORT, node 0) --c10d--> TCPStore server (127.0.0.1, another port)
//
// The gate passes a connection's bytes on to the store only after a challenge-response on
// the token (HMAC-SHA1 of both sides' random nonces, each side proving it to the other), so
// a client without the token never reads or writes a key, and a relay never talks to a
// server that does not hold the token. The store server itself is tied to the loopback
// interface (store_listen.h). What it does not protect: processes on the same host as a
// relay or the store (they reach them over loopback), and the traffic after the handshake,
// which is neither encrypted nor authenticated. docs/reliability.md, "The rendezvous store".
#pragma once
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

namespace c10d {
class Store;
}

namespace tessera::distributed {

// The job's rendezvous token: the contents of the file TESSERA_RDZV_TOKEN_FILE names (without
// surrounding whitespace), or TESSERA_RDZV_TOKEN itself; nullopt when neither is set. Throws
// tessera::Error naming the variable or the file when both are set, the file cannot be read,
// or the token is empty.
std::optional<std::string> rendezvous_token();

// HMAC-SHA1 of `message` under `key` (RFC 2104): 20 raw bytes.
std::string hmac_sha1(const std::string& key, const std::string& message);

// Node 0's side: listens on `public_port` on every interface (IPv6 and IPv4) and passes each
// connection on to 127.0.0.1:`store_port` once its client proved `token`. Refusals are
// reported on stderr with the peer's address (the first 20, then every 1000th).
class StoreGate {
 public:
  StoreGate(int public_port, int store_port, std::string token);
  ~StoreGate();  // stops listening, ends every connection, joins its threads
  StoreGate(const StoreGate&) = delete;
  StoreGate& operator=(const StoreGate&) = delete;
  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

// A client's side: listens on 127.0.0.1 (a free port, port()) and passes each connection on
// to the gate at `addr`:`port` after the handshake. It keeps trying to reach the gate for
// `timeout` (node 0 may start later), as c10d's client does.
class StoreRelay {
 public:
  StoreRelay(const std::string& addr, int port, std::string token, std::chrono::milliseconds timeout);
  ~StoreRelay();
  StoreRelay(const StoreRelay&) = delete;
  StoreRelay& operator=(const StoreRelay&) = delete;
  int port() const;
  // Why the last connection to the gate failed ("" when none did), e.g. a token mismatch.
  std::string last_error() const;
  // Whether the gate refused this process's token, or failed to prove its own: no later try
  // can succeed.
  bool refused() const;
  // The store `make` creates (a c10d client of port()), or tessera::Error with last_error() as
  // soon as the gate refuses: c10d's client would otherwise try again until its timeout. `make`
  // runs on a thread of its own, left behind when the gate refuses.
  c10::intrusive_ptr<c10d::Store> connect(std::function<c10::intrusive_ptr<c10d::Store>()> make);
  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace tessera::distributed
