"""The preset data ships with the package: found from the editable install the tests run on, and from a
built wheel installed elsewhere (the data package ``memplan._presets``, mapped to presets/ in pyproject)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).parents[1]
SHIPPED = sorted(
    f"{kind}/{p.name}" for kind in ("models", "gpus") for p in (ROOT / "presets" / kind).glob("*.toml")
)


def test_every_package_is_listed_for_the_wheel() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "memplan").rglob("__init__.py")
    }
    assert found | {"memplan._presets"} == listed


def test_presets_are_found_from_the_editable_install() -> None:
    folder = resources.files("memplan._presets")
    found = sorted(f"{kind}/{f.name}" for kind in ("models", "gpus") for f in (folder / kind).iterdir())
    assert found == SHIPPED and len(SHIPPED) > 20


def test_presets_ship_in_the_wheel_and_load_from_it(tmp_path: Path) -> None:
    # Built from a copy of the sources (a build in the checkout would leave build/ behind).
    src = tmp_path / "src"
    for part in ("memplan", "presets", "pyproject.toml", "README.md"):
        copy = shutil.copytree if (ROOT / part).is_dir() else shutil.copy
        copy(
            ROOT / part,
            src / part,
            **({"ignore": shutil.ignore_patterns("__pycache__")} if (ROOT / part).is_dir() else {}),
        )
    wheel_cmd = ["wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(src)]
    subprocess.run([sys.executable, "-m", "pip", *wheel_cmd], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("memplan-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert sorted(n.removeprefix("memplan/_presets/") for n in names if n.endswith(".toml")) == SHIPPED
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "memplan").rglob("*.py")}
    assert {n for n in names if n.endswith(".py") and not n.startswith("memplan/_presets/")} == modules
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )
    code = (
        "import memplan.presets as p, sys; "
        "assert p.__file__.startswith(sys.argv[1]), p.__file__; "
        "print(p.load_model_preset('mixtral').published_params, len(p.gpu_names()))"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-I",
            "-c",
            f"import sys; sys.path.insert(0, {str(site)!r}); exec({code!r})",
            str(site),
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert out.stdout.split() == ["46702792704", str(len(list((ROOT / "presets/gpus").glob("*.toml"))))]
