"""pyproject's explicit package list names every package directory; stages import as
dew_pipe.stages; nothing generic is installed at the top level."""

import importlib
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _config():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _package_dirs(folder: Path, dotted: str) -> set[str]:
    found = set()
    for init in folder.rglob("__init__.py"):
        rel = init.parent.relative_to(folder)
        if "__pycache__" in rel.parts:
            continue
        found.add(".".join([dotted, *rel.parts]))
    return found


def test_package_list_names_every_package_directory():
    config = _config()
    listed = set(config["packages"])
    on_disk = _package_dirs(ROOT / "dew_pipe", "dew_pipe") | _package_dirs(
        ROOT / "stages", "dew_pipe.stages"
    )
    assert on_disk - listed == set(), "package folders missing from pyproject packages"
    assert listed - on_disk == set(), "pyproject lists packages that do not exist"


def test_stages_map_into_dew_pipe_and_nothing_generic_is_installed():
    config = _config()
    assert config["package-dir"]["dew_pipe.stages"] == "stages"
    for name in config["packages"]:
        assert name == "dew_pipe" or name.startswith("dew_pipe."), name


def test_folders_without_init_are_not_silently_left_out():
    # a folder of .py modules with no __init__.py would be skipped by an explicit list
    for base in (ROOT / "dew_pipe", ROOT / "stages"):
        for folder in base.rglob("*"):
            if folder.is_dir() and folder.name != "__pycache__" and any(folder.glob("*.py")):
                assert (folder / "__init__.py").exists(), f"{folder} has modules but no __init__.py"


def test_import_dew_pipe_stages():
    stages = importlib.import_module("dew_pipe.stages")
    folder = Path(stages.__file__).resolve().parent
    # the top-level stages/ folder of a checkout (this one, or the one installed editable)
    assert folder.name == "stages" and (folder.parent / "pyproject.toml").is_file()
