#!/usr/bin/env python3
"""A TCP relay that delays every chunk it forwards by DELAY ± JITTER ms
(uniform), each direction on its own, without reordering a stream: a chunk
leaves at max(its arrival + its drawn delay, when the chunk before it left).

    relay.py --seed S --delay-ms 20 --jitter-ms 10 LHOST:LPORT=THOST:TPORT ...

One process, one thread, a selector: every listener accepts, connects to its
target (non-blocking) and forwards both ways. End of stream is passed on
(shutdown of the write side) after the data before it; an error on either
side closes both. A direction stops reading while 1 MiB of it waits, so a
slow reader slows its writer as a real link would. Prints "ready" once
every listener is bound, its counters (connections accepted, connects to a
target that failed, bytes) on SIGUSR1 and when it stops on SIGTERM; each
failed accept or connect on stderr. Standard library only.
"""
import argparse
import heapq
import json
import os
import random
import selectors
import signal
import socket
import sys
import time

MAX_BUFFERED = 1 << 20


class Pipe:
    """One direction of one connection: bytes read from src, written to dst."""

    def __init__(self, conn, src, dst):
        self.conn, self.src, self.dst = conn, src, dst
        self.pending = []  # [(due, bytes or None for end of stream)], due non-decreasing
        self.out = b""  # due bytes not yet accepted by dst
        self.buffered = 0
        self.last_due = 0.0
        self.eof_read = False
        self.eof_sent = False
        self.reading = True


class Conn:
    def __init__(self, relay, client, target):
        self.relay = relay
        self.client, self.server = client, target
        self.connected = False
        self.closed = False
        self.up = Pipe(self, client, target)
        self.down = Pipe(self, target, client)


class Relay:
    def __init__(self, routes, delay_ms, jitter_ms, seed):
        self.sel = selectors.DefaultSelector()
        self.rng = random.Random(seed)
        self.delay, self.jitter = delay_ms / 1000.0, jitter_ms / 1000.0
        self.timers = []  # heap of (due, seq, pipe)
        self.seq = 0
        self.interest = {}  # socket -> events wanted
        self.owner = {}  # socket -> (conn, role)
        self.stats = {"accepted": 0, "connect_failed": 0, "accept_failed": 0, "reset": 0,
                      "bytes": 0}
        for listen, target in routes:
            ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind(listen)
            ls.listen(512)
            ls.setblocking(False)
            self.sel.register(ls, selectors.EVENT_READ, ("listen", target))

    # -- selector bookkeeping -------------------------------------------------
    def want(self, sock, events):
        old = self.interest.get(sock, 0)
        if old == events:
            return
        if old and events:
            self.sel.modify(sock, events, "conn")
        elif events:
            self.sel.register(sock, events, "conn")
        else:
            self.sel.unregister(sock)
        self.interest[sock] = events

    def update(self, conn):
        if conn.closed:
            return
        for sock in (conn.client, conn.server):
            ev = 0
            if sock is conn.server and not conn.connected:
                ev = selectors.EVENT_WRITE
            else:
                for p in (conn.up, conn.down):
                    if p.src is sock and p.reading and not p.eof_read and p.buffered < MAX_BUFFERED:
                        ev |= selectors.EVENT_READ
                    if p.dst is sock and p.out:
                        ev |= selectors.EVENT_WRITE
            self.want(sock, ev)

    def close(self, conn):
        if conn.closed:
            return
        conn.closed = True
        for sock in (conn.client, conn.server):
            if self.interest.get(sock):
                self.sel.unregister(sock)
            self.interest.pop(sock, None)
            self.owner.pop(sock, None)
            try:
                sock.close()
            except OSError:
                pass

    # -- events -----------------------------------------------------------------
    def accept(self, ls, target):
        try:
            client, _ = ls.accept()
        except OSError as e:
            self.stats["accept_failed"] += 1
            print("accept: %s" % e, file=sys.stderr, flush=True)
            return
        self.stats["accepted"] += 1
        client.setblocking(False)
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setblocking(False)
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = Conn(self, client, server)
        self.owner[client] = conn
        self.owner[server] = conn
        err = server.connect_ex(target)
        if err not in (0, 115):  # EINPROGRESS
            self.stats["connect_failed"] += 1
            print("connect %s: %s" % (target, os.strerror(err)), file=sys.stderr, flush=True)
            self.close(conn)
            return
        self.update(conn)

    def readable(self, conn, sock):
        pipe = conn.up if sock is conn.client else conn.down
        try:
            data = sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.stats["reset"] += 1
            self.close(conn)
            return
        self.stats["bytes"] += len(data)
        now = time.monotonic()
        drawn = self.rng.uniform(self.delay - self.jitter, self.delay + self.jitter)
        due = max(now + max(0.0, drawn), pipe.last_due)
        pipe.last_due = due
        if data:
            pipe.pending.append((due, data))
            pipe.buffered += len(data)
        else:
            pipe.eof_read = True
            pipe.pending.append((due, None))
        self.seq += 1
        heapq.heappush(self.timers, (due, self.seq, pipe))
        self.update(conn)

    def flush(self, pipe):
        conn = pipe.conn
        if conn.closed:
            return
        while pipe.out:
            try:
                n = pipe.dst.send(pipe.out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.close(conn)
                return
            pipe.buffered -= n
            pipe.out = pipe.out[n:]
        if not pipe.out and pipe.eof_read and not pipe.pending and not pipe.eof_sent:
            pipe.eof_sent = True
            try:
                pipe.dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        if conn.up.eof_sent and conn.down.eof_sent:
            self.close(conn)
            return
        self.update(conn)

    def release_due(self):
        now = time.monotonic()
        while self.timers and self.timers[0][0] <= now:
            _, _, pipe = heapq.heappop(self.timers)
            while pipe.pending and pipe.pending[0][0] <= now:
                _, data = pipe.pending.pop(0)
                if data:
                    pipe.out += data
            if pipe.conn.connected:
                self.flush(pipe)

    def run(self):
        while True:
            timeout = None
            if self.timers:
                timeout = max(0.0, self.timers[0][0] - time.monotonic())
            for key, events in self.sel.select(timeout):
                if key.data[0] == "listen":
                    self.accept(key.fileobj, key.data[1])
                    continue
                sock = key.fileobj
                conn = self.owner.get(sock)
                if conn is None or conn.closed:
                    continue
                if sock is conn.server and not conn.connected:
                    err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if err:
                        self.stats["connect_failed"] += 1
                        print("connect: %s" % os.strerror(err), file=sys.stderr, flush=True)
                        self.close(conn)
                        continue
                    conn.connected = True
                    self.flush(conn.up)
                    continue
                if events & selectors.EVENT_READ:
                    self.readable(conn, sock)
                if not conn.closed and events & selectors.EVENT_WRITE:
                    self.flush(conn.up if sock is conn.server else conn.down)
            self.release_due()


def parse_route(text):
    listen, _, target = text.partition("=")
    lh, _, lp = listen.rpartition(":")
    th, _, tp = target.rpartition(":")
    return (lh, int(lp)), (th, int(tp))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--delay-ms", type=float, default=20.0)
    ap.add_argument("--jitter-ms", type=float, default=10.0)
    ap.add_argument("routes", nargs="+", help="LHOST:LPORT=THOST:TPORT")
    args = ap.parse_args()
    relay = Relay([parse_route(r) for r in args.routes], args.delay_ms, args.jitter_ms, args.seed)

    def stop(*_):
        print("relay: %s" % json.dumps(relay.stats), flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGUSR1,
                  lambda *_: print("relay: %s" % json.dumps(relay.stats), flush=True))
    print("ready", flush=True)
    relay.run()


if __name__ == "__main__":
    main()
