"""Build the wheelhouse the GPU check installs from: the project wheel plus what the GPU machine lacks.

    python bench/build_wheelhouse.py [--dir wheelhouse]     # needs a package index (here, not on the GPU machine)
    python bench/build_wheelhouse.py --list                 # the packages and the install line; downloads nothing

The GPU machine has torch, triton, transformers (with tokenizers, huggingface_hub, tqdm), peft, safetensors, aiohttp
and pyyaml, and no package index. `bench/gpu_check.py` imports, beyond those, the project itself and `EXTRA`
below: found by running the check with each candidate hidden from the import system (the list is what failed
without it). Ray, SGLang, matplotlib and math-verify are not imported by the check (its rewards fall back without
math-verify), so they stay out; requests and its deps are in as a precaution (cheap, pure Python).

`pip download --no-deps` fetches exactly these wheels (pure Python, any platform), and dependencies the GPU machine
lacks are listed by name rather than resolved, so the index is never asked to pick a different torch. On the GPU
machine:

    pip install --no-index --find-links wheelhouse --no-deps rl-multilora <EXTRA...>

The folder is kept out of git (.gitignore).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What the check imports that the GPU machine lacks, with the pure-Python deps each one pulls in.
EXTRA = (
    "datasets",  # the tenants' data sources (rollout.data_source)
    "pyarrow",  # datasets' storage (a binary wheel: fetched for the GPU machine's platform, see --platform)
    "dill",
    "multiprocess",
    "xxhash",
    "fsspec",
    "pandas",  # the check fails at import without it (datasets imports it at module level)
    "python-dateutil",
    "pytz",
    "tzdata",
    "six",
    "requests",  # datasets' downloads module imports it even for local files
    "charset-normalizer",
    "idna",
    "urllib3",
    "certifi",
    "pydantic",  # the run config (rl_multilora.config)
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "pytest",  # the check's cpu_oracle_tests section
    "pluggy",
    "iniconfig",
)


def install_line(folder: str) -> str:
    return f"pip install --no-index --find-links {folder} --no-deps rl-multilora {' '.join(EXTRA)}"


def build(folder: Path, python_version: str, platform: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "wheel", "--no-deps", "--wheel-dir", str(folder), str(ROOT)], check=True)
    subprocess.run(
        [*pip, "download", "--no-deps", "--only-binary=:all:", "--dest", str(folder),
         "--python-version", python_version, "--platform", platform, *EXTRA],
        check=True,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="wheelhouse", help="where the wheels go")
    p.add_argument("--list", action="store_true", help="print the packages and the install line; download nothing")
    p.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}",
                   help="the GPU machine's Python (binary wheels are fetched for it)")  # fmt: skip
    p.add_argument("--platform", default="manylinux2014_x86_64", help="the GPU machine's wheel platform tag")
    args = p.parse_args()
    if args.list:
        print("rl-multilora (pip wheel --no-deps of this checkout)")
        print("\n".join(EXTRA))
        print(install_line(args.dir))
        return
    build(Path(args.dir), args.python_version, args.platform)
    print(install_line(args.dir))


if __name__ == "__main__":
    main()
