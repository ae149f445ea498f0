// Rendezvous of a job's ranks at MASTER_ADDR:MASTER_PORT: the TCPStore every rank
// connects to (rank 0 hosts it unless torchrun's agent does), a count of the ranks
// that reached it, and the one-line errors when it fails (libtorch's own messages
// carry a C++ backtrace and rarely say which address, rank or timeout was involved),
// and a free port to hold it on.
#pragma once
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <exception>
#include <string>

#include "tessera/distributed/world.h"

namespace tessera::distributed {

// Connects to the store (rank 0: starts it) and counts this rank as joined. Throws
// CommError in one line naming the rank, the address and port and the timeout.
c10::intrusive_ptr<c10d::Store> connect_store(const World& world, std::chrono::milliseconds timeout);

// The process group could not be created on this rank after the store was reached
// (typically: a peer never came). Throws CommError in one line with how many of the
// ranks reached the store, when the store still answers.
[[noreturn]] void throw_join_failure(const World& world, c10d::Store& store, std::chrono::milliseconds timeout,
                                     std::chrono::milliseconds waited, const std::exception& cause);

// A TCP port free on every address (bind the wildcard to port 0, read it, close): the
// MASTER_PORT `tessera run` gives a one-node job when none is named, and the port of a
// store behind the rendezvous token's gate. The stores bind the wildcard ([::] and
// 0.0.0.0), which any socket bound to one address at that port blocks (Gloo's pairs bind
// the interface's address): a port free on loopback alone was such a port now and then.
int find_free_port();

// The first line of an exception's message, without the backtrace libtorch appends.
std::string short_error(const std::exception& e);

}  // namespace tessera::distributed
