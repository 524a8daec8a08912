"""The image recipe: one multi-arch image with both entrypoints, running as non-root.

No container runtime here (the e2e workflow builds and runs it); these checks read the Dockerfile
and make sure what it promises exists in the package.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def final_stage() -> str:
    return re.split(r"^FROM ", DOCKERFILE, flags=re.M)[-1]


def test_final_stage_runs_as_a_numeric_non_root_user():
    users = re.findall(r"^USER\s+(\S+)", final_stage(), flags=re.M)
    assert users, "the final stage sets no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0  # numeric, so runAsNonRoot can verify it


def test_no_architecture_is_hard_coded():
    assert not re.search(r"amd64|x86_64|aarch64|arm64", "\n".join(
        line for line in DOCKERFILE.splitlines() if not line.lstrip().startswith("#")
    ))  # fmt: skip
    assert re.search(r"^FROM python:\$\{PYTHON_VERSION\}-slim", DOCKERFILE, flags=re.M)  # multi-arch base


def test_both_entrypoints_exist():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["superinfer"].startswith("superinfer.cli.main:")
    assert importlib.util.find_spec("superinfer.operator.__main__") is not None
    assert 'CMD ["superinfer", "serve"' in DOCKERFILE
    assert "superinfer.operator.main" in DOCKERFILE  # imported at build time


def test_the_image_gets_every_package_pip_installs():
    """`pip install .` in the image needs every folder pyproject.toml maps a package to."""
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    copied = set(re.findall(r"^COPY (?!--from)(\S+)", DOCKERFILE, flags=re.M))
    assert set(package_dirs.values()) <= copied


def test_dockerignore_keeps_the_context_small():
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    assert lines.count("*") == 1
    copied = set(re.findall(r"^COPY (?!--from)(\S+)", DOCKERFILE, flags=re.M))
    allowed = {line.lstrip("!").rstrip("/") for line in lines if line.startswith("!")}
    assert copied <= allowed | {"pyproject.toml"}
