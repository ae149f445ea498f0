// Keeping a rendezvous store off the network it does not need (internal to the
// distributed layer; used where this process starts a c10d TCPStore server: rank 0 in
// rendezvous.cpp, node 0's launcher in launch/rounds.cpp).
//
// c10d's TCPStore server listens on every interface of the host (1.13 binds the
// wildcard address, IPv4 and IPv6; its TCPStoreOptions name a port, never an address or a
// socket), and answers anyone who connects: a plain TCPStore client from another machine
// could read and write a job's keys. For a job on one node every rank reaches the store at
// MASTER_ADDR on this host, so the store's listening sockets are tied to the network
// interface that carries MASTER_ADDR (the loopback interface for 127.0.0.1 or localhost)
// with SO_BINDTODEVICE, after c10d opened them: the kernel then refuses a connection that
// arrives on any other interface. That is a property of the socket, whatever c10d does
// with it, so the same code serves libtorch 1.13 and 2.x.
//
// What it does not do: refuse another user of the same host who connects through the
// loopback interface, nor anyone on the interface's own network when MASTER_ADDR is not a
// loopback address; a job of several nodes keeps listening everywhere (its other nodes
// may come through any interface). See docs/reliability.md, "The rendezvous store".
#pragma once
#include <string>

namespace tessera::distributed {

// Ties every TCP socket of this process listening on `port` to the interface that carries
// `addr` (MASTER_ADDR), and shuts down connections already accepted on that port from a
// non-loopback peer when that interface is the loopback one (a connection that came in
// before the socket was tied). Returns "" when done; otherwise a one-line warning that says
// why the store still listens on every interface (naming MASTER_ADDR or the failed call).
std::string confine_store_listener(const std::string& addr, int port);

// The interface whose addresses include `addr` (a name or a numeric address; any 127.x or
// ::1 address is the loopback interface), or "" when `addr` is not an address of this host.
std::string interface_of(const std::string& addr);

}  // namespace tessera::distributed
