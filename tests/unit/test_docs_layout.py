"""docs/development.md's layout table names every module of the project's packages in its folder's row, so a module
added without a word there fails here instead of leaving the table behind the tree."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = (
    "flows",
    "flows/cli",
    "tasks",
    "tasks/engines",
    "tasks/engines/pytorch",
    "tasks/engines/onnx",
    "tasks/engines/llama_cpp",
    "tasks/inputs",
    "tasks/techniques",
    "tasks/techniques/quantize",
    "tasks/weights",
    "tasks/measure",
)
PACKAGES += ("tasks/decide", "tasks/report", "serving")


def layout_rows() -> dict[str, str]:
    """folder (as the table writes it, without the trailing slash) -> the text of its row."""
    text = (REPO / "docs" / "development.md").read_text()
    section = text.split("## The layout", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\| `([^`]+)/` \| (.*) \|$", line)
        if match:
            rows[match.group(1)] = match.group(2)
    return rows


def test_every_module_is_named_in_its_folders_row():
    rows = layout_rows()
    missing = []
    for package in PACKAGES:
        assert package in rows, f"docs/development.md's layout table has no row for {package}/"
        named = set(re.findall(r"`([A-Za-z_][\w/]*)`", rows[package]))
        for module in sorted((REPO / package).glob("*.py")):
            if module.stem not in ("__init__", "__main__") and module.stem not in named:
                missing.append(f"{package}/{module.name}")
    assert not missing, f"modules docs/development.md's layout table does not name: {missing}"


def test_subfolders_of_the_server_are_named_with_their_modules():
    row = layout_rows()["serving"]
    for module in sorted((REPO / "serving" / "api").glob("*.py")):
        if module.stem != "__init__":
            assert f"`{module.stem}`" in row, f"serving/api/{module.name}"
