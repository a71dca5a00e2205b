"""Time to install one host from the offline bundle, step by step.

Runs the bundle's own `kunlun-installer install --role R` (as an operator does on a host) into a
temporary prefix, etc, unit and data folder, and prints the wall time of each step the installer
logs (the time until its next line), the total, and the CPU time the install used (its children).
The bundle is `make dist`'s folder (default dist/kunlun-<version>). Nothing outside the temporary
folder is touched (`--user root`: no service user is created).
Usage: python -m bench.install_host [--bundle dist/kunlun-0.1.0] [--role gateway] [--python PY] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kunlun_common.pki import ClusterCerts, init_cluster_certs
from kunlun_installer.bundle import project_version

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {
    "gateway": "name: gateway-1\nlisten: 127.0.0.1:8080\nstatic_endpoints: ['chat=127.0.0.1:9']\n",
    "control-plane": "name: replica-1\ncert_dir: /etc/kunlun/certs\nlisten: 127.0.0.1:50051\n"
    "etcd_endpoints: [https://127.0.0.1:2379]\n",
}


def child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", default=str(ROOT / "dist" / f"kunlun-{project_version(ROOT)}"))
    p.add_argument("--role", choices=sorted(CONFIGS), default="gateway")
    p.add_argument(
        "--python", default=sys.executable, help="the interpreter the host runs the installer with"
    )
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    bundle = Path(a.bundle)
    if not (bundle / "kunlun-installer").is_file():
        sys.exit(f"{bundle}: not a bundle folder; build it with `make dist`")
    tmp = Path(tempfile.mkdtemp(prefix="kunlun-bench-install-"))
    try:
        init_cluster_certs(tmp / "all", ClusterCerts(nodes=("node-a",)))
        certs = tmp / "certs"
        shutil.copytree(tmp / "all", certs)
        cfg = tmp / "config.yaml"
        cfg.write_text(CONFIGS[a.role])
        dirs = ["--prefix", str(tmp / "opt"), "--etc", str(tmp / "etc"), "--unit-dir", str(tmp / "units")]
        argv = [str(bundle / "kunlun-installer"), "install", "--role", a.role, "--config", str(cfg)]
        argv += ["--certs", str(certs), "--user", "root", *dirs, "--data", str(tmp / "data")]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHON": a.python, "HOME": str(tmp)}
        cpu0, t0 = child_cpu(), time.monotonic()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        assert proc.stdout is not None
        steps: list[tuple[str, float]] = []
        last_step, last_t = "start", t0
        for line in proc.stdout:
            now = time.monotonic()
            steps.append((last_step, now - last_t))
            last_step, last_t = line.strip()[:300], now
        rc = proc.wait()
        total = time.monotonic() - t0
        cpu = child_cpu() - cpu0
        if rc != 0:
            sys.exit(f"install failed ({rc}); last line: {last_step}")
        load = os.getloadavg()[0]
        if a.json:
            print(json.dumps({"role": a.role, "total_s": total, "cpu_s": cpu, "load1": load, "steps": steps}))
            return
        print(f"install --role {a.role} from {bundle} (python {a.python}, load average {load:.1f}):")
        for name, secs in steps[1:]:
            print(f"  {secs:6.1f} s  {name}")
        print(f"total {total:.1f} s wall, {cpu:.1f} s CPU")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
