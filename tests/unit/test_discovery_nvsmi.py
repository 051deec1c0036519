"""The `nvidia-smi -q -x` fixtures against what NVIDIA's drivers write, and the parser against
NVIDIA's own DTD where this machine has one.

NVIDIA publishes the device DTD (nvsmi_device_vNN.dtd) inside its driver: `nvidia-smi --dtd`
prints it. It is not in Debian's main archive, nor under a licence that lets it be copied into
this repository, so it is used where a driver provides it: `$NODUS_NVSMI_DTD` (a file), else
`nvidia-smi --dtd` of an installed driver, else a copy under /usr/share/doc. Without any, those
tests skip and say why; the structural check (element names, nesting, order and units, as
drivers of each DTD version write them: tests/fixtures/discovery/nvsmi-structure.json) always
runs."""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from libs.discovery.gpus import NVSMI_DTD_VERSIONS, parse_nvidia_smi_xml
from tests.nvsmi_fixtures import DOCUMENTS, FIXTURES, check_structure

NVIDIA_FIXTURES = sorted(FIXTURES.glob("nvidia-smi-q-x-*.xml"))
DTD_VERSION = re.compile(r"nvsmi_device_v(\d+)\.dtd")


def _driver_dtd() -> tuple[str, str] | None:
    """(where it came from, the DTD's text), from what this machine has."""
    given = os.environ.get("NODUS_NVSMI_DTD")
    if given:
        return given, Path(given).read_text()
    if shutil.which("nvidia-smi") is not None:
        done = subprocess.run(
            ["nvidia-smi", "--dtd"], capture_output=True, text=True, timeout=30, check=False
        )
        if done.returncode == 0 and "<!ELEMENT" in done.stdout:
            return "nvidia-smi --dtd", done.stdout
    for path in sorted(Path("/usr/share/doc").glob("nvidia*/**/nvsmi_device*.dtd")):
        return str(path), path.read_text()
    return None


def _validator() -> tuple[str, object]:
    lxml = pytest.importorskip("lxml.etree", reason="lxml (the dev extra) validates DTDs")
    found = _driver_dtd()
    if found is None:
        pytest.skip(
            "no NVIDIA device DTD on this machine: no $NODUS_NVSMI_DTD, no nvidia-smi "
            "(a driver prints it with `nvidia-smi --dtd`), none under /usr/share/doc/nvidia*"
        )
    _, text = found
    version = DTD_VERSION.search(text[:400])
    return (version.group(1) if version else "?"), lxml.DTD(io.StringIO(text))


def _validate(dtd: object, document: str) -> tuple[bool, str]:
    from lxml import etree

    parser = etree.XMLParser(load_dtd=False, no_network=True, resolve_entities=False)
    tree = etree.fromstring(document.encode(), parser)
    valid = dtd.validate(tree)  # type: ignore[attr-defined]
    return valid, str(dtd.error_log.filter_from_errors())  # type: ignore[attr-defined]


@pytest.mark.parametrize("path", NVIDIA_FIXTURES, ids=lambda p: p.name)
def test_fixtures_are_shaped_as_drivers_write_them(path: Path) -> None:
    text = path.read_text()
    assert check_structure(text) == []
    assert int(DTD_VERSION.findall(text)[0]) in NVSMI_DTD_VERSIONS
    # The files are what the builder writes: a change to one is a change to both.
    assert text == DOCUMENTS[path.name]()


def test_the_structural_check_sees_what_a_driver_would_not_write() -> None:
    text = (FIXTURES / "nvidia-smi-q-x-8xH100.xml").read_text()
    moved = text.replace("<product_name>", "<product_nam>").replace(
        "</product_name>", "</product_nam>"
    )
    assert any("product_nam: not an element" in p for p in check_structure(moved))
    swapped = text.replace("81559 MiB", "80 GB", 1)
    assert any("fb_memory_usage/total '80 GB'" in p for p in check_structure(swapped))
    reordered = re.sub(
        r"(<driver_version>.*?</driver_version>)\s*(<cuda_version>.*?</cuda_version>)",
        r"\2\1",
        text,
        count=1,
    )
    assert any("do not follow the DTD's order" in p for p in check_structure(reordered))


@pytest.mark.parametrize("path", NVIDIA_FIXTURES, ids=lambda p: p.name)
def test_fixtures_are_valid_against_nvidias_dtd(path: Path) -> None:
    version, dtd = _validator()
    text = path.read_text()
    if f"nvsmi_device_v{version}.dtd" not in text:
        pytest.skip(f"this machine's DTD is v{version}; {path.name} is written to another")
    valid, errors = _validate(dtd, text)
    assert valid, errors


def test_this_machines_nvidia_smi_is_valid_and_read_whole() -> None:
    """On a GPU machine: the driver's own output against the driver's own DTD, then parsed
    with nothing the parser did not understand."""
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no nvidia-smi on this machine (no NVIDIA driver)")
    _, dtd = _validator()
    done = subprocess.run(
        ["nvidia-smi", "-q", "-x"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    valid, errors = _validate(dtd, done.stdout)
    assert valid, errors
    report = parse_nvidia_smi_xml(done.stdout)
    assert report.gpus and report.warnings == [], report.warnings
