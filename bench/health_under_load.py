"""/health while hostile prompts arrive (issue 29, item 1): `python -m pysmoe serve` on the demo
vault in its own process; four ~1 MB completion prompts that cannot fit its context are posted at
once while /health is polled. Prints idle and worst /health latency, the four statuses and the
server's peak RSS (VmHWM).

    python bench/health_under_load.py        (run it from the checkout to measure)
"""
import http.client
import json
import re
import subprocess
import sys
import tempfile
import threading
import time


def main() -> None:
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        p = subprocess.Popen([sys.executable, "-m", "pysmoe", "serve", "--port", "0", "--cache-mb", "64",
                              "--max-batch", "2", "--threads", "1"], stderr=log)
        try:
            for _ in range(600):
                m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", open(log.name).read())
                if m:
                    break
                time.sleep(0.1)
            port = int(m.group(1))
            body = json.dumps({"prompt": ("Some ordinary English prose about Python. " * 30000)[:1_000_000],
                               "max_tokens": 1}).encode()

            def post(out):
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                c.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
                r = c.getresponse()
                r.read()
                out.append(r.status)

            def health():
                t = time.perf_counter()
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                c.request("GET", "/health")
                c.getresponse().read()
                return time.perf_counter() - t

            idle = min(health() for _ in range(5))
            statuses, worst = [], 0.0
            posts = [threading.Thread(target=post, args=(statuses,)) for _ in range(4)]
            for t in posts:
                t.start()
            while any(t.is_alive() for t in posts):
                worst = max(worst, health())
                time.sleep(0.01)
            for t in posts:
                t.join()
            hwm = next(line for line in open(f"/proc/{p.pid}/status") if line.startswith("VmHWM")).split()[1]
            print(f"idle /health {idle * 1e3:.1f} ms; worst /health during 4 x 1 MB prompts {worst * 1e3:.1f} ms; "
                  f"statuses {statuses}; server peak RSS {int(hwm) / 1024:.0f} MiB")
        finally:
            p.terminate()
            p.wait(30)


if __name__ == "__main__":
    main()
