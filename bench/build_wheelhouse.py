"""Build the wheelhouse the GPU check installs from: the project wheel plus what the GPU machine lacks.

    python bench/build_wheelhouse.py [--dir wheelhouse] [--with-data]   # needs a package index (here, not there)
    python bench/build_wheelhouse.py --list [--with-data]               # the packages and install line; no download

The GPU machine has torch, triton, transformers (with tokenizers, huggingface_hub, tqdm), peft, safetensors, aiohttp
and pyyaml, and no package index. Beyond those, `bench/gpu_check.py` imports the project, `CORE` and, for its two
GRPO sections only, `DATA` below: found by running the check with each candidate hidden from the import system as if
not installed. Ray, SGLang, matplotlib and requests are not imported by the check, so they stay out.

`pip download --no-deps` fetches exactly these wheels at the versions installed here (binary ones for the GPU
machine's Python and platform: `--python-version`, `--platform`); nothing is resolved against the index, so it is
never asked to pick a different torch. On the GPU machine:

    pip install --no-index --find-links wheelhouse --no-deps rl-multilora <the names --list prints>

The folder is kept out of git (.gitignore).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What the check imports that the GPU machine lacks, with the deps each pulls in. CORE is what every section but the
# two GRPO ones needs (pydantic: the run config, imported by the library at module level; pytest and pytest-timeout:
# the gpu_tests and cpu_oracle_tests sections, each GPU test cut at 120 s), about 3 MB. DATA is what the GRPO sections add: `datasets` (the tenants' datasets) and
# the two packages it pins tightly, and math-verify with its parser (the tiny preset's arith reward, imported in the
# reward workers: without it that tenant fails every step, as the first H100 run on 2026-11-26 showed), about 1.3 MB. Its other deps (pyarrow, pandas, xxhash, fsspec, huggingface_hub) are
# in the GPU image (the device's KINDS.md package list, read 2026-11-17); pyarrow alone is 55 MB, more than the 64 MiB
# the device tool carries with the working tree, so it is not carried. datasets here needs pyarrow >= 24: where the
# image's is older, the GRPO sections record the import error and the rest of the check runs.
CORE = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "pytest", "pluggy", "iniconfig",
        "pytest-timeout")  # fmt: skip
DATA = ("datasets", "dill", "multiprocess", "math-verify", "latex2sympy2_extended", "antlr4-python3-runtime")


def pinned(names: tuple[str, ...]) -> list[str]:
    """`names` at the versions installed here (the set the test suite runs with: datasets pins dill and multiprocess
    tightly, so the newest of each alone may not import together)."""
    out = []
    for name in names:
        try:
            out.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            out.append(name)
    return out


def install_line(folder: str, names: tuple[str, ...]) -> str:
    return f"pip install --no-index --find-links {folder} --no-deps rl-multilora {' '.join(names)}"


def build(folder: Path, names: tuple[str, ...], python_version: str, platforms: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "wheel", "--no-deps", "--wheel-dir", str(folder), str(ROOT)], check=True)
    subprocess.run(
        [*pip, "download", "--no-deps", "--only-binary=:all:", "--dest", str(folder),
         "--python-version", python_version, *(a for p in platforms for a in ("--platform", p)), *pinned(names)],
        check=True,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="wheelhouse", help="where the wheels go")
    p.add_argument("--list", action="store_true", help="print the packages and the install line; download nothing")
    p.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}",
                   help="the GPU machine's Python (binary wheels are fetched for it)")  # fmt: skip
    p.add_argument(
        "--platform",
        action="append",
        help="the GPU machine's wheel platform tags (repeatable; default manylinux_2_28_x86_64 and manylinux2014_x86_64)",
    )
    p.add_argument(
        "--with-data",
        action="store_true",
        help="add datasets and math-verify with their pinned deps (the GRPO sections; ~1.3 MB)",
    )
    args = p.parse_args()
    names = CORE + DATA if args.with_data else CORE
    if args.list:
        print("rl-multilora (pip wheel --no-deps of this checkout)")
        print("\n".join(pinned(names)))
        print(install_line(args.dir, names))
        return
    platforms = args.platform or ["manylinux_2_28_x86_64", "manylinux2014_x86_64"]
    build(Path(args.dir), names, args.python_version, platforms)
    print(install_line(args.dir, names))


if __name__ == "__main__":
    main()
