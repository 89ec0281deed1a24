"""CPU time per streamed token of each process of a served run: the API server, the engine core and the
`deepinfer bench serve` client, from /proc/<pid>/stat over the run; with SPY=seconds, py-spy profiles of each
(raw collapsed stacks, the last run). Starts `deepinfer serve` itself (SERVER_ARGS), warms it up, then one
benchmark per RUNS entry ("concurrency:prompts"), random INLEN/OUTLEN prompts. Linux only.

    RUNS="64:128 256:512" SERVER_ARGS="--max-num-seqs 256 --max-model-len 2048" OUTD=/tmp/sv python bench/serve_cpu.py

It answers which process is the bottleneck: one near 100% of a core caps what the others can do.
"""
import json, os, subprocess, sys, time, urllib.request
PORT = int(os.environ.get("PORT", 8131)); OUTD = os.environ.get("OUTD", "/tmp/sv"); os.makedirs(OUTD, exist_ok=True)
TAG = os.environ.get("TAG", "run"); INLEN = os.environ.get("INLEN", "512"); OUTLEN = int(os.environ.get("OUTLEN", 128))
RUNS = [tuple(map(int, r.split(":"))) for r in os.environ.get("RUNS", "64:128").split()]
extra = os.environ.get("SERVER_ARGS", "--max-num-seqs 256 --max-model-len 2048").split()
SPYBIN = os.environ.get("SPYBIN", "py-spy")
def cpu(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
def kids(pid):
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1]) == pid: out.append(int(p))
            except OSError: pass
    return out
srv = subprocess.Popen([sys.executable, "-m", "deepinfer.server", "--port", str(PORT), *extra],
                       stdout=open(f"{OUTD}/server_{TAG}.log", "w"), stderr=subprocess.STDOUT)
for _ in range(600):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2).close(); break
    except Exception: time.sleep(0.5)
time.sleep(1)
allp = [srv.pid] + kids(srv.pid)
names = {srv.pid: "api"}
for k in allp[1:]:
    names[k] = "core" if "spawn" in open(f"/proc/{k}/cmdline").read() else f"child{k}"
print(TAG, "server pids", names, file=sys.stderr)
def bench(n, c, out_len, fn, spy=None):
    cmd = [sys.executable, "-m", "deepinfer.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{PORT}", "--backend", "openai",
           "--dataset-name", "random", "--random-input-len", INLEN, "--random-output-len", str(out_len), "--random-range-ratio", "0",
           "--num-prompts", str(n), "--max-concurrency", str(c), "--ignore-eos", "--seed", "0", "--disable-tqdm",
           "--save-result", "--result-dir", OUTD, "--result-filename", fn]
    t0 = {p: cpu(p) for p in allp}; w0 = time.time()
    cl = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    spies = []
    if spy:
        time.sleep(4)
        spies = [subprocess.Popen([SPYBIN, "record", "--nonblocking", "-r", "250", "-d", str(spy), "--format", "raw", "-o", f"{OUTD}/spy_{TAG}_{nm}.txt", "--pid", str(pid)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for nm, pid in [("client", cl.pid)] + [(names[p], p) for p in allp]]
    ct = 0.0
    while cl.poll() is None:
        try: ct = cpu(cl.pid)
        except OSError: pass
        time.sleep(0.05)
    wall = time.time() - w0
    for sp in spies: sp.wait()
    res = json.load(open(f"{OUTD}/{fn}"))
    toks = res.get("total_output_tokens") or res["completed"] * out_len
    return wall, toks, {p: cpu(p) - t0[p] for p in allp}, ct, res
bench(64, 64, 16, f"{TAG}_warm.json")
for i, (c, n) in enumerate(RUNS):
    spy = int(os.environ["SPY"]) if os.environ.get("SPY") and i == len(RUNS) - 1 else None
    wall, toks, d, ct, res = bench(n, c, OUTLEN, f"{TAG}_c{c}.json", spy)
    print(f"[{TAG}] c={c} n={n}: wall {wall:.1f} s, {toks} tokens, {res['output_throughput']:.0f} tok/s, TPOT {res['mean_tpot_ms']:.2f} ms"
          + "".join(f" | {names[p]} {1e6*s/toks:.0f} us/tok {100*s/wall:.0f}%core" for p, s in d.items())
          + f" | client {1e6*ct/toks:.0f} us/tok {100*ct/wall:.0f}%core", flush=True)
srv.terminate(); srv.wait()
