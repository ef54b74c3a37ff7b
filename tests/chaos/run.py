#!/usr/bin/env python3
"""Chaos across real network boundaries (issue 10): prefill, decode and router
each in a network namespace of their own, joined by veth pairs, UCX over tcp
between prefill and decode, bootstrap tokens on; one fault at a time, under a
seeded abort storm through the router. See tests/chaos/README.md.

    run.py PDSERVE                    # every fault, a fresh seed (printed)
    CHAOS_SEED=1234 run.py PDSERVE    # replay a seed
    CHAOS_FAULTS=linkdown,sigstop run.py PDSERVE
    CHAOS_REQUESTS=500                # requests per storm (at least 500 unless CHAOS_SMALL=1)

Needs root and `ip netns`; otherwise prints SKIPPED and exits 77 (ctest's
SKIP_RETURN_CODE). Python standard library only.
"""
import ctypes
import http.client
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
SKIP = 77

# ---- the network -----------------------------------------------------------------------
# Each namespace's own address sits on its loopback (a /32), so taking one link down
# never takes a node's address away; the links carry /30s and a route per peer.
ADDR = {"p": "10.213.0.1", "d": "10.213.0.2", "r": "10.213.0.3"}
# (namespace a, device in a, address in a, namespace b, device in b, address in b)
LINKS = {
    "pd": ("p", "to-d", "10.213.1.1", "d", "to-p", "10.213.1.2"),
    "rp": ("r", "to-p", "10.213.2.1", "p", "to-r", "10.213.2.2"),
    "rd": ("r", "to-d", "10.213.3.1", "d", "to-r", "10.213.3.2"),
}
HTTP_PORT = {"p": 30001, "d": 30002, "r": 30000}
BOOT_PORT = 8998
# Delay fault: the relay (in the router's namespace) fronts both nodes' HTTP ports
# and the prefill's bootstrap port; the router and the decode node use these.
RELAY_PORT = {"p": 31001, "d": 31002, "boot": 18998}

# The nodes' documented transport deadlines (docs/bootstrap-protocol.md, "Timeouts";
# the node runtime uses the defaults): a peer silent for DEAD_AFTER is dead, and a
# destination that had left the decode node stays quarantined DRAIN_GRACE longer.
DEAD_AFTER_S = 5.0
DRAIN_GRACE_S = 5.0
QUARANTINE_SLACK_S = 3.0  # sampling, scheduling on 2 shared cores
# The nodes keep their default deadlines (bootstrap 30 s, transfer 60 s); the router's
# is above both, and the clients' well above the router's. A router-made 504 (no answer
# from a node within ROUTER_TIMEOUT_S) is a failure: some node never ended a request.
ROUTER_TIMEOUT_S = 120
CLIENT_TIMEOUT_S = 180
ROUTER_TIMEOUT_TEXT = "no answer within the request timeout"
IDLE_CLEAN_LIMIT_S = 60


def log(msg):
    print(msg, flush=True)


class Skip(Exception):
    pass


def sh(*cmd, check=True):
    r = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError("%s: exit %d: %s" % (" ".join(cmd), r.returncode, r.stderr.strip()))
    return r


libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1


def die_with_parent():
    """preexec_fn: a child is SIGKILLed when this (main) thread goes away, so a
    killed test leaves no server behind."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class Net:
    """Three namespaces (prefill, decode, router) and the veth pairs between them."""

    def __init__(self):
        self.id = os.getpid()
        self.ns = {k: "pdchaos%d%s" % (self.id, k) for k in ("p", "d", "r")}
        self.created = []

    def ex(self, who, *cmd, check=True):
        return sh("ip", "netns", "exec", self.ns[who], *cmd, check=check)

    @staticmethod
    def remove_stale():
        """Namespaces of an earlier run that was killed before its cleanup."""
        for line in sh("ip", "netns", "list").stdout.splitlines():
            m = re.match(r"(pdchaos(\d+)[pdr])\b", line)
            if not m:
                continue
            try:
                os.kill(int(m.group(2)), 0)
                continue  # its run is still going
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
            sh("ip", "netns", "del", m.group(1), check=False)

    def up(self):
        for k in ("p", "d", "r"):
            sh("ip", "netns", "add", self.ns[k])
            self.created.append(self.ns[k])
            self.ex(k, "ip", "link", "set", "lo", "up")
            self.ex(k, "ip", "addr", "add", ADDR[k] + "/32", "dev", "lo")
        for name, (a, da, ia, b, db, ib) in LINKS.items():
            sh("ip", "link", "add", da, "netns", self.ns[a], "type", "veth", "peer", "name", db,
               "netns", self.ns[b])
            for who, dev, ip in ((a, da, ia), (b, db, ib)):
                self.ex(who, "ip", "addr", "add", ip + "/30", "dev", dev)
                self.ex(who, "ip", "link", "set", dev, "up")
            self.routes(name)

    def routes(self, name):
        """Each end reaches the other's own address over this link, from its own."""
        a, da, ia, b, db, ib = LINKS[name]
        self.ex(a, "ip", "route", "replace", ADDR[b] + "/32", "via", ib, "dev", da, "src", ADDR[a])
        self.ex(b, "ip", "route", "replace", ADDR[a] + "/32", "via", ia, "dev", db, "src", ADDR[b])

    def enter(self, who):
        """Moves this thread (call it before any other thread exists) into a namespace."""
        fd = os.open("/run/netns/" + self.ns[who], os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                e = ctypes.get_errno()
                raise OSError(e, "setns: " + os.strerror(e))
        finally:
            os.close(fd)

    def down(self):
        for ns in self.created:
            # Rules and qdiscs live in the namespace and go with it; remove them
            # first anyway, so nothing is left if the namespace outlives us.
            sh("ip", "netns", "exec", ns, "iptables", "-F", check=False)
            for dev in ("to-d", "to-p", "to-r"):
                sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
                sh("ip", "netns", "exec", ns, "ip", "link", "del", dev, check=False)
            sh("ip", "netns", "del", ns, check=False)
        self.created = []


def probe_environment():
    if os.geteuid() != 0:
        raise Skip("needs root (network namespaces, veth, iptables, tc)")
    for tool in ("ip", "tc", "iptables"):
        if not shutil.which(tool):
            raise Skip("`%s` is not installed (scripts/deps.sh installs it)" % tool)
    name = "pdchaosprobe%d" % os.getpid()
    r = sh("ip", "netns", "add", name, check=False)
    if r.returncode != 0:
        raise Skip("`ip netns add` does not work here: " + r.stderr.strip())
    try:
        checks = [
            ["ip", "link", "add", "pa", "type", "veth", "peer", "name", "pb"],
            ["iptables", "-A", "OUTPUT", "-o", "pa", "-m", "statistic", "--mode", "random",
             "--probability", "0.01", "-j", "DROP"],
            ["tc", "qdisc", "add", "dev", "pa", "root", "tbf", "rate", "10mbit", "burst", "32kb",
             "latency", "100ms"],
        ]
        for cmd in checks:
            r = sh("ip", "netns", "exec", name, *cmd, check=False)
            if r.returncode != 0:
                raise Skip("`%s` fails in a namespace: %s" % (" ".join(cmd), r.stderr.strip()))
        r = sh("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "pb", "root", "netem",
               "delay", "1ms", check=False)
        return r.returncode == 0
    finally:
        sh("ip", "netns", "del", name, check=False)


# ---- processes ---------------------------------------------------------------------------
class Proc:
    """A process started in a namespace (ip netns exec), output to a log file."""

    def __init__(self, net, who, name, args, logdir, env=None):
        self.name, self.who = name, who
        self.log_path = os.path.join(logdir, "%s.%d.log" % (name, int(time.time() * 1000)))
        self.log = open(self.log_path, "w")
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.proc = subprocess.Popen(["ip", "netns", "exec", net.ns[who]] + list(args),
                                     stdout=self.log, stderr=subprocess.STDOUT, env=full_env,
                                     preexec_fn=die_with_parent)
        self.pid = self.proc.pid

    def alive(self):
        return self.proc.poll() is None

    def output(self, n=3000):
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def send(self, sig):
        if self.alive():
            os.kill(self.pid, sig)

    def stop(self, sig=signal.SIGTERM, timeout=20):
        """Stops it; returns its exit status (None if it had to be killed)."""
        if self.alive():
            os.kill(self.pid, signal.SIGCONT)
            os.kill(self.pid, sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                self.log.close()
                return None
        self.log.close()
        return self.proc.returncode


def http_call(host, port, method, path, body=None, timeout=10):
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        data = json.dumps(body) if body is not None else None
        c.request(method, path, body=data, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        payload = r.read()
    finally:
        c.close()
    try:
        return r.status, json.loads(payload) if payload else None
    except ValueError:
        return r.status, payload.decode("utf-8", "replace")


class Cluster:
    """prefill + decode + router (+ the delay relay), fresh for each fault."""

    def __init__(self, net, pdserve, logdir, relay=False, seed=0):
        self.net, self.pdserve, self.logdir = net, pdserve, logdir
        self.token = "chaos-%016x" % random.getrandbits(64)
        self.gen = {"p": 0, "d": 0}  # bumped by a restart
        self.killed = []  # processes this test killed on purpose
        self.relay = self.p = self.d = self.r = None
        try:
            self.start_all(relay, seed)
        except BaseException:
            self.kill_all()
            raise

    def start_all(self, relay, seed):
        net, pdserve, logdir = self.net, self.pdserve, self.logdir
        if relay:
            boot = ADDR["r"], RELAY_PORT["boot"]
            routes = ["%s:%d=%s:%d" % (ADDR["r"], RELAY_PORT["p"], ADDR["p"], HTTP_PORT["p"]),
                      "%s:%d=%s:%d" % (ADDR["r"], RELAY_PORT["d"], ADDR["d"], HTTP_PORT["d"]),
                      "%s:%d=%s:%d" % (boot + (ADDR["p"], BOOT_PORT))]
            self.relay = Proc(net, "r", "relay", [sys.executable, os.path.join(HERE, "relay.py"),
                                                  "--seed", str(seed), "--delay-ms", "20",
                                                  "--jitter-ms", "10"] + routes, logdir)
            self.peer = "%s:%d" % boot
            p_url = "http://%s:%d@%d" % (ADDR["r"], RELAY_PORT["p"], RELAY_PORT["boot"])
            d_url = "http://%s:%d" % (ADDR["r"], RELAY_PORT["d"])
        else:
            self.peer = "%s:%d" % (ADDR["p"], BOOT_PORT)
            p_url = "http://%s:%d@%d" % (ADDR["p"], HTTP_PORT["p"], BOOT_PORT)
            d_url = "http://%s:%d" % (ADDR["d"], HTTP_PORT["d"])
        self.start("p")
        self.start("d")
        self.r = Proc(net, "r", "router", [pdserve, "router", "--host", ADDR["r"], "--port",
                                           str(HTTP_PORT["r"]), "--prefill", p_url, "--decode",
                                           d_url, "--health-interval-ms", "200",
                                           "--request-timeout-s", str(ROUTER_TIMEOUT_S)], logdir)
        self.wait_healthy("r")
        self.wait_pair()

    def node_args(self, who):
        common = ["--strict", "--transfer-backend", "ucx", "--bootstrap-token", self.token,
                  "--host", ADDR[who], "--port", str(HTTP_PORT[who]),
                  "--max-running-requests", "32", "--chunked-prefill-size", "256",
                  "--max-total-tokens", "24576",
                  # No prefix cache: the storm has few distinct prompts, and every request
                  # is to compute its whole prompt and move all its pages.
                  "--disable-prefix-cache"]
        if who == "p":
            return ["prefill"] + common + ["--disaggregation-bootstrap-port", str(BOOT_PORT)]
        return ["decode"] + common + ["--prefill-peers", self.peer]

    def start(self, who):
        env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": LINKS["pd"][1 if who == "p" else 4]}
        name = {"p": "prefill", "d": "decode"}[who]
        proc = Proc(self.net, who, name, [self.pdserve] + self.node_args(who), self.logdir, env)
        setattr(self, who, proc)
        self.wait_healthy(who)

    def restart(self, who):
        self.gen[who] += 1
        self.start(who)

    def proc(self, who):
        return getattr(self, who)

    def wait_healthy(self, who, timeout=60):
        proc = self.proc(who)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if not proc.alive():
                raise AssertionError("%s exited with %s:\n%s" % (proc.name, proc.proc.returncode,
                                                                 proc.output()))
            try:
                if http_call(ADDR[who], HTTP_PORT[who], "GET", "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError("%s not healthy:\n%s" % (proc.name, proc.output()))

    def wait_pair(self, timeout=30):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                st, info = http_call(ADDR["r"], HTTP_PORT["r"], "GET", "/server_info", timeout=5)
                if st == 200 and info.get("healthy_pair"):
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError("the router has no healthy pair:\n" + self.r.output())

    def info(self, who, timeout=2):
        st, obj = http_call(ADDR[who], HTTP_PORT[who], "GET", "/server_info", timeout=timeout)
        if st != 200:
            raise OSError("server_info: %d" % st)
        return obj

    def procs(self):
        return [x for x in (self.relay, self.p, self.d, self.r) if x is not None]

    def stop(self):
        """Stops everything; returns [(name, exit status)] of processes that did not stop
        cleanly (a node that crashed, or ended with an error)."""
        bad = []
        for proc in (self.r, self.d, self.p, self.relay):
            if proc is None:
                continue
            was_alive = proc.alive()
            st = proc.stop()
            if proc.name != "relay" and (not was_alive or st != 0):
                bad.append((proc.name, st, proc.output(1500)))
        for proc in self.killed:
            if not proc.log.closed:
                proc.log.close()
        return bad

    def kill_all(self):
        for proc in self.procs() + self.killed:
            try:
                proc.stop(signal.SIGKILL, timeout=5)
            except Exception:
                pass


# ---- the abort storm -----------------------------------------------------------------
PROMPT_BASE = ("The quick brown fox jumps over the lazy dog; pack my box with five dozen "
               "liquor jugs. 0123456789 ") * 40
PROMPT_LENGTHS = (3, 16, 48, 128, 320, 640)
MAX_NEW = (1, 6, 24, 96)


def prompt_text(k):
    n = PROMPT_LENGTHS[k]
    return (PROMPT_BASE[k * 7:] + PROMPT_BASE)[:n]


def references(pdserve):
    """Token ids `pdserve generate` gives each prompt (greedy, ignore_eos): every
    complete answer must equal ref[:max_new], every partial one be a prefix."""
    refs = []
    for k in range(len(PROMPT_LENGTHS)):
        out = subprocess.run([pdserve, "generate", "--prompt", prompt_text(k), "--max-new-tokens",
                              str(max(MAX_NEW)), "--ignore-eos", "--json"],
                             capture_output=True, text=True, check=True)
        refs.append(json.loads(out.stdout)["output_ids"])
    return refs


class Storm:
    """N requests through the router, paced, from a pool of client threads: plain and
    streaming /generate; a fraction aborted with /abort_request, a fraction abandoned
    by closing the connection. Every other client must get exactly one final answer."""

    def __init__(self, seed, n, refs, concurrency=40, pace_s=0.016):
        rng = random.Random(seed)
        self.n, self.refs, self.concurrency, self.pace = n, refs, concurrency, pace_s
        self.plan = []
        for i in range(n):
            action = rng.choices(("plain", "abort", "close"), (60, 25, 15))[0]
            self.plan.append({"i": i, "rid": "chaos-%d-%d" % (seed, i),
                              "stream": rng.random() < 0.5,
                              "prompt": rng.randrange(len(PROMPT_LENGTHS)),
                              "max_new": rng.choice(MAX_NEW), "action": action,
                              "delay": rng.uniform(0.0, 0.6)})
        self.results = [None] * n
        self.started = 0
        self.done = 0
        self.lock = threading.Lock()
        self.abort_calls = {}
        self.threads = []
        self.t0 = None

    def start(self):
        self.t0 = time.time()
        for w in range(self.concurrency):
            t = threading.Thread(target=self.worker, args=(w,), daemon=True)
            t.start()
            self.threads.append(t)

    def worker(self, w):
        while True:
            with self.lock:
                i = self.started
                if i >= self.n:
                    return
                self.started += 1
            wait = self.t0 + i * self.pace - time.time()
            if wait > 0:
                time.sleep(wait)
            try:
                res = self.one(self.plan[i])
            except Exception as e:  # a client error the checks below did not expect
                res = {"outcome": "bad", "detail": "client raised %r" % e}
            with self.lock:
                self.results[i] = res
                self.done += 1

    def join(self, timeout):
        deadline = time.time() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.time()))
        return time.time() - self.t0

    def body(self, req):
        return {"text": prompt_text(req["prompt"]), "rid": req["rid"], "stream": req["stream"],
                "sampling_params": {"max_new_tokens": req["max_new"], "ignore_eos": True}}

    def abort_later(self, req):
        def go():
            time.sleep(req["delay"])
            try:
                st, _ = http_call(ADDR["r"], HTTP_PORT["r"], "POST", "/abort_request",
                                  {"rid": req["rid"]}, timeout=CLIENT_TIMEOUT_S)
            except Exception as e:
                st = repr(e)
            with self.lock:
                self.abort_calls[req["i"]] = st
        t = threading.Thread(target=go, daemon=True)
        t.start()
        return t

    def one(self, req):
        body = self.body(req)
        if req["action"] == "close":
            raw = json.dumps(body).encode()
            s = socket.create_connection((ADDR["r"], HTTP_PORT["r"]), timeout=CLIENT_TIMEOUT_S)
            try:
                s.sendall(b"POST /generate HTTP/1.1\r\nHost: r\r\n"
                          b"Content-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(raw) + raw)
                time.sleep(req["delay"])
            finally:
                s.close()
            return {"outcome": "closed"}
        aborter = self.abort_later(req) if req["action"] == "abort" else None
        try:
            res = self.stream(body) if req["stream"] else self.plain(body)
        except socket.timeout:
            return {"outcome": "timeout", "detail": "no final answer in %ds" % CLIENT_TIMEOUT_S}
        if aborter:
            aborter.join(CLIENT_TIMEOUT_S)
        return self.judge(req, res)

    def plain(self, body):
        c = http.client.HTTPConnection(ADDR["r"], HTTP_PORT["r"], timeout=CLIENT_TIMEOUT_S)
        try:
            c.request("POST", "/generate", body=json.dumps(body),
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            payload = r.read()
        finally:
            c.close()
        try:
            obj = json.loads(payload)
        except ValueError:
            return {"status": r.status, "bad": "body is not JSON: %r" % payload[:200]}
        return {"status": r.status, "finals": [obj], "ids": obj.get("output_ids")}

    def stream(self, body):
        deadline = time.time() + CLIENT_TIMEOUT_S
        c = http.client.HTTPConnection(ADDR["r"], HTTP_PORT["r"], timeout=CLIENT_TIMEOUT_S)
        try:
            c.request("POST", "/generate", body=json.dumps(body),
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            if r.status != 200:
                payload = r.read()
                try:
                    return {"status": r.status, "finals": [json.loads(payload)], "ids": []}
                except ValueError:
                    return {"status": r.status, "bad": "error body not JSON: %r" % payload[:200]}
            events, buf = [], b""
            while True:
                if time.time() > deadline:
                    raise socket.timeout()
                chunk = r.read1(65536)
                if not chunk:
                    break
                buf += chunk
                while b"\n\n" in buf:
                    ev, buf = buf.split(b"\n\n", 1)
                    if not ev.startswith(b"data: "):
                        return {"status": 200, "bad": "not an SSE event: %r" % ev[:200]}
                    data = ev[6:].decode()
                    events.append(data if data == "[DONE]" else json.loads(data))
        finally:
            c.close()
        if buf.strip():
            return {"status": 200, "bad": "stream ends inside an event: %r" % buf[:200]}
        if not events or events[-1] != "[DONE]" or "[DONE]" in events[:-1]:
            return {"status": 200, "bad": "stream does not end with one [DONE]: %r" % events[-3:]}
        finals = [e for e in events[:-1] if "error" in e or
                  e.get("meta_info", {}).get("finish_reason") is not None]
        if finals and finals[-1] is not events[-2]:
            return {"status": 200, "bad": "events after the final one: %r" % events[-3:]}
        ids = next((e["output_ids"] for e in reversed(events[:-1]) if "output_ids" in e), [])  # cumulative
        return {"status": 200, "finals": finals, "ids": ids}

    def judge(self, req, res):
        """One final answer, of a documented shape (docs/http-api.md): a complete answer
        with the tokens `pdserve generate` gives; an abort (499) or a failure (an error
        body, or finish_reason abort with status_code 500/504) with a prefix of them."""
        if "bad" in res:
            return {"outcome": "bad", "detail": res["bad"]}
        finals = res["finals"]
        if len(finals) != 1:
            return {"outcome": "bad", "detail": "%d final answers: %r" % (len(finals), finals[:3])}
        final, status = finals[0], res["status"]
        want = self.refs[req["prompt"]][:req["max_new"]]
        ids = res["ids"] or []
        if ids != want[:len(ids)]:
            return {"outcome": "bad", "detail": "tokens are not a prefix of pdserve generate's: "
                    "%r vs %r" % (ids[:8], want[:8])}
        if "error" in final:
            err = final["error"]
            if status != 200 and err.get("code") != status:
                return {"outcome": "bad", "detail": "error code %r under status %d" %
                        (err.get("code"), status)}
            return {"outcome": "error", "status": err.get("code", status),
                    "detail": err.get("message", "")}
        reason = final.get("meta_info", {}).get("finish_reason") or {}
        kind, code = reason.get("type"), reason.get("status_code")
        if kind == "abort":
            if status != 200 and code != status:
                return {"outcome": "bad", "detail": "abort with status_code %r under status %d" %
                        (code, status)}
            if code == 499 and req["action"] == "abort":
                return {"outcome": "aborted"}
            return {"outcome": "error", "status": code,
                    "detail": "%s (%s)" % (reason.get("message", ""), code)}
        if status != 200:
            return {"outcome": "bad", "detail": "status %d without an error: %s" %
                    (status, json.dumps(final)[:300])}
        if kind != "length":
            return {"outcome": "bad", "detail": "finish_reason %r" % reason}
        if ids != want:
            return {"outcome": "bad", "detail": "%d tokens of %d" % (len(ids), len(want))}
        return {"outcome": "answer"}

    def summary(self):
        counts = {}
        for r in self.results:
            k = r["outcome"] if r else "timeout"
            counts[k] = counts.get(k, 0) + 1
        return counts


# ---- watching the nodes --------------------------------------------------------------
class Monitor(threading.Thread):
    """Samples every node's quarantined units every 100 ms, by room (the nodes run with
    --strict, so /server_info names the room of every quarantined unit). A room's
    quarantine time runs from the first sample that shows it to the first that does not:
    the longest of them is the quarantine-free time."""

    PERIOD_S = 0.1

    def __init__(self, cluster):
        super().__init__(daemon=True)
        self.cl = cluster
        self.rooms = {}  # (node, gen, room) -> [first seen, first seen gone or None]
        self.units_max = {"p": 0, "d": 0}
        self.stop_flag = threading.Event()
        self.last_t = time.time()

    def sample(self, who):
        gen = self.cl.gen[who]
        try:
            info = self.cl.info(who, timeout=1)
        except Exception:
            return  # stopped or restarting: no news, nothing ends
        now = time.time()
        pools = info["pools"]
        self.units_max[who] = max(self.units_max[who],
                                  sum(p.get("quarantine", 0) for p in pools["pools"]))
        held = {h["room"] for h in pools.get("holders", []) if h.get("state") == "quarantine"}
        for room in held:
            self.rooms.setdefault((who, gen, room), [now, None])
        for key, span in self.rooms.items():
            if key[0] == who and key[1] == gen and span[1] is None and key[2] not in held:
                span[1] = now

    def run(self):
        while not self.stop_flag.is_set():
            for who in ("p", "d"):
                self.sample(who)
            self.last_t = time.time()
            self.stop_flag.wait(self.PERIOD_S)

    def longest(self):
        """(seconds, rooms seen quarantined); a room of a killed process ends with it."""
        best = 0.0
        for (who, gen, _), (t1, t2) in self.rooms.items():
            if t2 is None:
                t2 = self.last_t if gen == self.cl.gen[who] else t1
            best = max(best, t2 - t1)
        return best, len(self.rooms)

    def finish(self):
        self.stop_flag.set()
        if self.is_alive():
            self.join(5)


def wait_idle_clean(cl, who, timeout=IDLE_CLEAN_LIMIT_S):
    deadline = time.time() + timeout
    info = None
    while time.time() < deadline:
        try:
            info = cl.info(who)
            if info.get("idle") and info.get("idle_clean"):
                return info
        except Exception:
            pass
        time.sleep(0.05)
    raise AssertionError("%s not idle_clean after %ds: %s" % (cl.proc(who).name, timeout,
                                                             json.dumps(info)[:2000]))


def wait_router_idle(cl, timeout=15):
    """The router's count of requests in flight reaches 0; returns the last count."""
    deadline = time.time() + timeout
    in_flight = None
    while time.time() < deadline:
        try:
            _, info = http_call(ADDR["r"], HTTP_PORT["r"], "GET", "/server_info")
            in_flight = info["counters"]["in_flight"]
            if in_flight == 0:
                return 0
        except Exception as e:
            in_flight = repr(e)
        time.sleep(0.05)
    return in_flight


def fresh_request(cl, refs, timeout=30):
    """The router serves a new request after the fault (retrying while its health
    probes catch up with a restarted node); returns the seconds it took."""
    t0 = time.time()
    want = refs[2][:12]
    last = None
    while time.time() - t0 < timeout:
        try:
            st, obj = http_call(ADDR["r"], HTTP_PORT["r"], "POST", "/generate",
                                {"text": prompt_text(2), "sampling_params":
                                 {"max_new_tokens": 12, "ignore_eos": True}},
                                timeout=CLIENT_TIMEOUT_S)
            if st == 200:
                assert obj["output_ids"] == want, ("fresh request's tokens", obj, want)
                return time.time() - t0
            last = (st, obj)
        except OSError as e:
            last = repr(e)
        time.sleep(0.2)
    raise AssertionError("the router serves no fresh request after %ds: %r" % (timeout, last))


# ---- the faults --------------------------------------------------------------------------
class Fault:
    name = ""
    what = ""
    relay = False  # the cluster talks through the delay relay
    frozen_s = 0.0  # a node cannot free anything for this long (added to the bound)
    benign = False  # nothing is lost for good: every request must complete or abort

    def apply(self, net, cl):
        pass

    def during(self, net, cl, storm, rng):
        pass

    def evidence(self, net, cl):
        """(what the fault did, whether it did anything)"""
        return "", True

    def lift(self, net, cl):
        pass


def wait_mid_transfer(cl, storm, rng):
    """Until a random point 20-40 % into the storm with rooms open on the decode node
    (at least 4 requests waiting for their transfer; 2 s later at most)."""
    frac = rng.uniform(0.2, 0.4)
    while storm.started < frac * storm.n and any(t.is_alive() for t in storm.threads):
        time.sleep(0.02)
    deadline = time.time() + 2.0
    while time.time() < deadline:
        try:
            if cl.info("d", timeout=1)["counters"].get("wait_transfer", 0) >= 4:
                break
        except Exception:
            pass
        time.sleep(0.01)
    return frac


def link_packets(net, who, dev):
    text = net.ex(who, "cat", "/sys/class/net/%s/statistics/tx_packets" % dev).stdout
    return int(text.strip() or 0)


class Loss(Fault):
    name = "loss"
    what = "1% random loss (iptables statistic match, DROP) on the prefill-decode link, both ways"
    benign = True
    RULE = ["OUTPUT", "-m", "statistic", "--mode", "random", "--probability", "0.01", "-j", "DROP"]

    def apply(self, net, cl):
        for who, dev in (("p", "to-d"), ("d", "to-p")):
            net.ex(who, "iptables", "-A", self.RULE[0], "-o", dev, *self.RULE[1:])

    def evidence(self, net, cl):
        dropped = sent = 0
        for who, dev in (("p", "to-d"), ("d", "to-p")):
            out = net.ex(who, "iptables", "-L", "OUTPUT", "-v", "-x", "-n").stdout
            for line in out.splitlines():
                if "DROP" in line and "statistic" in line:
                    dropped += int(line.split()[0])
            sent += link_packets(net, who, dev)
        return "iptables dropped %d of %d packets" % (dropped, dropped + sent), dropped > 0

    def lift(self, net, cl):
        for who, dev in (("p", "to-d"), ("d", "to-p")):
            net.ex(who, "iptables", "-D", self.RULE[0], "-o", dev, *self.RULE[1:])


class Tbf(Fault):
    name = "tbf"
    what = "bandwidth limit: tbf 24 Mbit/s, 100 ms of queue, on the prefill-decode link"
    benign = True

    def apply(self, net, cl):
        for who, dev in (("p", "to-d"), ("d", "to-p")):
            net.ex(who, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", "24mbit",
                   "burst", "64kb", "latency", "100ms")

    def evidence(self, net, cl):
        out = net.ex("p", "tc", "-s", "qdisc", "show", "dev", "to-d").stdout
        m = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+)", out)
        if not m:
            return "tc: " + out.strip(), False
        return "tbf sent %.1f MB, %s packets dropped, %s overlimits (queued)" % (
            int(m.group(1)) / 1e6, m.group(3), m.group(4)), int(m.group(4)) > 0

    def lift(self, net, cl):
        for who, dev in (("p", "to-d"), ("d", "to-p")):
            net.ex(who, "tc", "qdisc", "del", "dev", dev, "root")


class Delay(Fault):
    name = "delay"
    what = ("20 +- 10 ms per chunk, each way, on the HTTP (router-prefill, router-decode) and "
            "bootstrap (decode-prefill) paths, through a userspace TCP relay")
    relay = True
    benign = True

    def evidence(self, net, cl):
        times = []
        for _ in range(3):
            t = time.time()
            http_call(ADDR["r"], RELAY_PORT["p"], "GET", "/health")
            times.append(time.time() - t)
        cl.relay.send(signal.SIGUSR1)
        time.sleep(0.3)
        lines = [x for x in cl.relay.output(100000).splitlines() if x.startswith("relay: ")]
        stats = json.loads(lines[-1][len("relay: "):]) if lines else {}
        return ("GET /health through the relay: %.0f ms at best; relayed %s connections, %.1f MB, "
                "%s failed connects to a node" % (min(times) * 1000, stats.get("accepted"),
                                                   stats.get("bytes", 0) / 1e6,
                                                   stats.get("connect_failed")),
                min(times) >= 0.015 and stats.get("accepted", 0) > 0)


class NoFault(Fault):
    name = "none"
    what = "no fault (a baseline; not in the default list)"
    benign = True


class LinkDown(Fault):
    name = "linkdown"
    what = "the prefill-decode link down for 3 s in the middle of transfers, then up again"
    frozen_s = 0.0

    def during(self, net, cl, storm, rng):
        self.at = wait_mid_transfer(cl, storm, rng)
        net.ex("p", "ip", "link", "set", "to-d", "down")
        time.sleep(3.0)
        self.lift(net, cl)

    def lift(self, net, cl):
        net.ex("p", "ip", "link", "set", "to-d", "up")
        net.routes("pd")  # routes through a link are dropped with it

    def evidence(self, net, cl):
        return "down at %d%% of the storm" % (self.at * 100), True


class SigStop(Fault):
    name = "sigstop"
    what = "SIGSTOP of the decode node for 5 s in the middle of transfers, then SIGCONT"
    frozen_s = 5.0

    def during(self, net, cl, storm, rng):
        self.at = wait_mid_transfer(cl, storm, rng)
        cl.d.send(signal.SIGSTOP)
        time.sleep(5.0)
        cl.d.send(signal.SIGCONT)

    def lift(self, net, cl):
        cl.d.send(signal.SIGCONT)

    def evidence(self, net, cl):
        return "stopped at %d%% of the storm" % (self.at * 100), True


class Kill(Fault):
    frozen_s = 0.0

    def __init__(self, who):
        self.who = who
        role = {"p": "prefill", "d": "decode"}[who]
        self.name = "kill-" + role
        self.what = ("SIGKILL of the %s node in the middle of transfers, restarted 0.5 s later"
                     % role)

    def during(self, net, cl, storm, rng):
        self.at = wait_mid_transfer(cl, storm, rng)
        victim = cl.proc(self.who)
        victim.send(signal.SIGKILL)
        victim.proc.wait()
        cl.killed.append(victim)
        time.sleep(0.5)
        cl.restart(self.who)

    def evidence(self, net, cl):
        return "killed at %d%% of the storm" % (self.at * 100), True


class Netem(Fault):
    benign = True

    def __init__(self, name, what, args):
        self.name, self.what, self.args = name, what, args

    def apply(self, net, cl):
        for who, dev in (("p", "to-d"), ("d", "to-p")):
            net.ex(who, "tc", "qdisc", "add", "dev", dev, "root", "netem", *self.args)

    def evidence(self, net, cl):
        out = net.ex("p", "tc", "-s", "qdisc", "show", "dev", "to-d").stdout
        m = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+)", out)
        if not m:
            return "tc: " + out.strip(), False
        return "netem sent %s packets, dropped %s" % (m.group(2), m.group(3)), int(m.group(2)) > 0

    def lift(self, net, cl):
        for who, dev in (("p", "to-d"), ("d", "to-p")):
            net.ex(who, "tc", "qdisc", "del", "dev", dev, "root")


def all_faults(has_netem, extra=False):
    faults = [Loss(), Tbf(), Delay(), LinkDown(), SigStop(), Kill("d"), Kill("p")]
    if has_netem:
        faults += [Netem("netem-loss", "netem: 1% loss on the prefill-decode link", ["loss", "1%"]),
                   Netem("netem-delay", "netem: 20 +- 10 ms on the prefill-decode link",
                         ["delay", "20ms", "10ms"])]
    if extra:
        faults.append(NoFault())
    return faults


# ---- one fault, start to end -------------------------------------------------------------
SANITIZER_WORDS = ("AddressSanitizer", "LeakSanitizer", "ThreadSanitizer", "runtime error:",
                   "assertion failed", "Assertion")


def run_fault(fault, net, pdserve, logdir, seed, n, refs):
    """Returns a dict of figures; 'failures' lists what went wrong."""
    t0 = time.time()
    fig = {"fault": fault.name, "seed": seed, "requests": n, "failures": []}
    fail = fig["failures"].append
    rng = random.Random("%d/%s" % (seed, fault.name))
    try:
        cl = Cluster(net, pdserve, logdir, relay=fault.relay, seed=seed)
    except Exception as e:
        fail("the cluster did not start: %s" % e)
        fig["wall_s"] = time.time() - t0
        return fig
    mon = Monitor(cl)
    mon.start()
    clean_stop = lifted = False
    try:
        fault.apply(net, cl)
        storm = Storm(seed, n, refs)
        storm.start()
        fault.during(net, cl, storm, rng)
        fig["storm_s"] = storm.join(CLIENT_TIMEOUT_S + n * storm.pace + 60)
        t_end = time.time()
        counts = storm.summary()
        for k in ("answer", "aborted", "closed", "error", "timeout", "bad"):
            fig[k] = counts.get(k, 0)
        fig["error_status"], fig["error_kinds"] = {}, {}
        for r, q in zip(storm.results, storm.plan):
            if r and r["outcome"] == "error":
                key = str(r.get("status"))
                fig["error_status"][key] = fig["error_status"].get(key, 0) + 1
                detail = re.sub(r"\d+", "N", r.get("detail", ""))[:90]
                kind = "%s %s: %s" % (q["action"], key, detail)
                fig["error_kinds"][kind] = fig["error_kinds"].get(kind, 0) + 1
        for i, r in enumerate(storm.results):
            if r is None or r["outcome"] in ("timeout", "bad"):
                fail("request %d (%s): %s" % (i, storm.plan[i], r["detail"] if r else "no answer"))
            elif r["outcome"] == "error" and ROUTER_TIMEOUT_TEXT in r.get("detail", ""):
                fail("request %d (%s): the router timed out, a node never ended it: %s" %
                     (i, storm.plan[i], r["detail"]))
        plain_errors = [r for r, q in zip(storm.results, storm.plan)
                        if r and r["outcome"] == "error" and q["action"] == "plain"]
        fig["plain_errors"] = len(plain_errors)
        if fault.benign and plain_errors:
            details = sorted({r.get("detail", "")[:120] for r in plain_errors})
            fail("%d requests nobody aborted failed under a fault that loses nothing for good: %s"
                 % (len(plain_errors), details[:4]))
        odd_aborts = {i: st for i, st in storm.abort_calls.items() if st not in (200, 404)}
        if odd_aborts:
            fail("/abort_request answered outside 200/404: %r" % dict(list(odd_aborts.items())[:5]))
        for who in ("p", "d"):
            info = wait_idle_clean(cl, who)
            if info["counters"].get("ownership_violations"):
                fail("%s: ownership violations %r" % (who, info["counters"]))
        fig["idle_clean_s"] = time.time() - t_end
        in_flight = wait_router_idle(cl)
        if in_flight:
            fail("router: %r requests still in flight 15 s after every client was answered" %
                 in_flight)
        fig["evidence"], took_effect = fault.evidence(net, cl)
        if not took_effect:
            fail("the fault had no effect: " + fig["evidence"])
        lifted = True
        fault.lift(net, cl)
        fig["fresh_s"] = fresh_request(cl, refs)
        for who in ("p", "d"):
            wait_idle_clean(cl, who)
        mon.finish()
        fig["quarantine_s"], fig["quarantine_rooms"] = mon.longest()
        fig["quarantine_units"] = max(mon.units_max.values())
        fig["quarantine_bound_s"] = (DEAD_AFTER_S + DRAIN_GRACE_S + fault.frozen_s +
                                     QUARANTINE_SLACK_S)
        if fig["quarantine_s"] > fig["quarantine_bound_s"]:
            fail("units stayed quarantined %.1fs, over the dead-peer grace bound %.1fs" %
                 (fig["quarantine_s"], fig["quarantine_bound_s"]))
        clean_stop = True
    except Exception as e:
        fail("%s: %s" % (type(e).__name__, e))
        traceback.print_exc()
    finally:
        mon.finish()
        if not lifted:  # the next fault starts on a clean network
            try:
                fault.lift(net, cl)
            except Exception:
                pass
        if clean_stop:
            for name, st, out in cl.stop():
                fail("%s did not stop cleanly (exit %s):\n%s" % (name, st, out))
        else:
            cl.kill_all()
        for proc in cl.procs() + cl.killed:
            text = proc.output(200000)
            for word in SANITIZER_WORDS:
                if word in text:
                    fail("%s's log mentions %r: %s" % (proc.name, word, proc.log_path))
                    break
        if fig["failures"]:
            for proc in cl.procs() + cl.killed:
                log("---- %s (%s), last lines:\n%s" % (proc.name, proc.log_path, proc.output(1500)))
    fig["wall_s"] = time.time() - t0
    return fig


def report(fault, fig):
    log("== %s: %s" % (fault.name, fault.what))
    if "answer" in fig:
        errs = ", ".join("%s x%d" % kv for kv in sorted(fig["error_status"].items()))
        log("   seed=%d requests=%d answers=%d aborted=%d closed=%d errors=%d%s timeouts=%d "
            "bad=%d" %
            (fig["seed"], fig["requests"], fig["answer"], fig["aborted"], fig["closed"],
             fig["error"], " (%s)" % errs if errs else "", fig["timeout"], fig["bad"]))
    if "quarantine_s" in fig:
        log("   storm %.1fs; idle_clean %.2fs after the last answer; quarantine-free time %.2fs "
            "(longest of %d rooms quarantined, at most %d units at once; bound %.1fs); "
            "fresh request %.2fs; %s" %
            (fig["storm_s"], fig["idle_clean_s"], fig["quarantine_s"], fig["quarantine_rooms"],
             fig["quarantine_units"], fig["quarantine_bound_s"], fig["fresh_s"], fig["evidence"]))
    if os.environ.get("CHAOS_VERBOSE"):
        for kind, count in sorted(fig.get("error_kinds", {}).items(), key=lambda kv: -kv[1]):
            log("     %4d x %s" % (count, kind))
    for f in fig["failures"]:
        log("   FAILURE: " + f)
    log("   %s (%.1fs)" % ("FAIL" if fig["failures"] else "PASS", fig["wall_s"]))


def table(figs):
    log("\n%-12s %10s %5s %7s %7s %6s %6s %8s %10s %12s  %s" % (
        "fault", "seed", "reqs", "answers", "aborted", "closed", "errors", "timeouts",
        "idle_clean", "quarantine", "result"))
    for f in figs:
        if "quarantine_s" not in f:
            log("%-12s %s" % (f["fault"], "FAIL"))
            continue
        log("%-12s %10d %5d %7d %7d %6d %6d %8d %9.2fs %11.2fs  %s" % (
            f["fault"], f["seed"], f["requests"], f["answer"], f["aborted"], f["closed"],
            f["error"], f["timeout"], f["idle_clean_s"], f["quarantine_s"],
            "FAIL" if f["failures"] else "PASS"))


class Interrupted(BaseException):
    pass


def on_signal(signum, frame):
    raise Interrupted("signal %d" % signum)  # SIGALRM (14): the budget


def main():
    pdserve = os.environ.get("PDSERVE") or (sys.argv[1] if len(sys.argv) > 1 else "")
    pdserve = os.path.abspath(pdserve)
    if not os.access(pdserve, os.X_OK):
        log("usage: run.py PDSERVE (or PDSERVE=...)")
        return 2
    try:
        has_netem = probe_environment()
    except Skip as e:
        log("SKIPPED: " + str(e))
        return SKIP
    seed = int(os.environ.get("CHAOS_SEED") or random.SystemRandom().randrange(1, 1 << 31))
    n = int(os.environ.get("CHAOS_REQUESTS") or 500)
    if n < 500 and os.environ.get("CHAOS_SMALL") != "1":
        log("CHAOS_REQUESTS=%d: the suite's storms have at least 500 requests (CHAOS_SMALL=1 to "
            "allow fewer while developing)" % n)
        return 2
    faults = all_faults(has_netem)
    only = [x for x in os.environ.get("CHAOS_FAULTS", "").split(",") if x]
    if only:
        known = all_faults(has_netem, extra=True)
        unknown = set(only) - {f.name for f in known}
        if unknown:
            log("unknown CHAOS_FAULTS %s; faults here: %s" % (sorted(unknown),
                                                             ",".join(f.name for f in known)))
            return 2
        faults = [f for f in known if f.name in only]
    log("chaos: seed %d (replay: CHAOS_SEED=%d), %d requests per fault, faults %s; netem %s" %
        (seed, seed, n, ",".join(f.name for f in faults),
         "available" if has_netem else "not in this kernel (skipped)"))
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGALRM):
        signal.signal(sig, on_signal)
    budget = int(os.environ.get("CHAOS_BUDGET_S") or 0)
    if budget:
        signal.alarm(budget)
    t0 = time.time()
    refs = references(pdserve)
    logdir = "/tmp/pdchaos-%d" % os.getpid()
    os.makedirs(logdir, exist_ok=True)
    Net.remove_stale()
    net = Net()
    figs = []
    current = None
    try:
        net.up()
        net.enter("r")
        for f in faults:
            current = f.name
            fig = run_fault(f, net, pdserve, logdir, seed, n, refs)
            report(f, fig)
            figs.append(fig)
    except Interrupted as e:
        why = "CHAOS_BUDGET_S=%d ran out" % budget if "14" in str(e) else str(e)
        log("chaos: interrupted during %s (%s); cleaning up" % (current, why))
        figs.append({"fault": current or "setup", "failures": [why]})
    finally:
        net.down()
    table(figs)
    failed = [f["fault"] for f in figs if f["failures"]]
    log("chaos: %d faults, %d failed%s; seed %d; %.0fs" %
        (len(figs), len(failed), (" (%s)" % ",".join(failed)) if failed else "", seed,
         time.time() - t0))
    if failed:
        log("replay: CHAOS_SEED=%d CHAOS_FAULTS=%s %s %s %s; logs in %s" %
            (seed, ",".join(failed), sys.executable, os.path.abspath(__file__), pdserve, logdir))
        return 1
    shutil.rmtree(logdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
