"""Installs the carried wheels (``bench_serve.py`` on a GPU machine with no network) into a target folder.

sglang-jax 0.1.0rc0 on the machine's jax: the pinned-or-too-new ones (FORCE) always, every other wheel only where its
distribution is missing there (the machine's own torch, numpy, jax stay)."""

import importlib.metadata as md
import pathlib
import subprocess
import sys

FORCE = {"flax", "transformers", "tokenizers", "huggingface_hub", "fastapi", "starlette", "uvicorn", "pydantic",
         "pydantic_core", "typing_inspection", "annotated_types", "sglang_jax", "pathwaysutils", "openai"}


def main(wheel_dir: str, target: str) -> int:
    chosen, skipped = [], []
    for whl in sorted(pathlib.Path(wheel_dir).glob("*.whl")):
        name = whl.name.split("-")[0].lower().replace("-", "_")
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            have = None
        if name in FORCE or have is None:
            chosen.append(str(whl))
        else:
            skipped.append(f"{name} (has {have})")
    print("installing:", " ".join(pathlib.Path(w).name for w in chosen))
    print("already there:", ", ".join(skipped))
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--target", target, *chosen]
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
