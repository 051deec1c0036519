"""Property tests (S3): whatever a GPU tool prints (garbage, truncated or mangled output, any
JSON, any value where a number belongs), each parser returns a report or raises
DiscoveryError with a reason; nothing else escapes, and no guessed value gets in."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from libs.discovery.gpus import (
    AMD_SMI_UNITS,
    BYTES,
    NVIDIA_SMI_UNITS,
    DiscoveryError,
    GpuReport,
    memory_mib,
    parse_amd_smi_static,
    parse_nvidia_smi_xml,
    parse_rocm_smi,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "discovery"
H100 = (FIXTURES / "nvidia-smi-q-x-8xH100.xml").read_text()
AMD = json.loads((FIXTURES / "amd-smi-static-json-8xMI300X.json").read_text())
ROCM = json.loads((FIXTURES / "rocm-smi-json-8xMI300X.json").read_text())
PARSERS: list[Callable[[str], GpuReport]] = [
    parse_nvidia_smi_xml,
    parse_amd_smi_static,
    parse_rocm_smi,
]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=30),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=20,
)
# What stands where a value belongs: numbers, units, the tools' "not available" words, junk.
values = st.one_of(
    json_values,
    st.sampled_from(
        ["N/A", "[N/A]", "[Not Supported]", "0", "-1", "81559 MiB", "1e309 MiB", "12 GB", ""]
    ),
    st.builds(
        lambda n, u: f"{n} {u}",
        st.integers(min_value=-5, max_value=2**80) | st.floats(allow_nan=True),
        st.sampled_from(["MiB", "MB", "GiB", "B", "KiB", "TiB", "%", ""]),
    ),
)


def _reads(parser: Callable[[str], GpuReport], text: str) -> None:
    try:
        report = parser(text)
    except DiscoveryError as error:
        assert str(error)
        return
    for gpu in report.gpus:
        assert gpu.memory_mib >= 0 and re.fullmatch(
            r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", gpu.pci_bus_id
        )
    assert all(isinstance(w, str) and w for w in report.warnings)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=400) | st.binary(max_size=200).map(lambda b: b.decode("latin-1")))
def test_any_text_is_a_report_or_a_clear_error(text: str) -> None:
    for parser in PARSERS:
        _reads(parser, text)


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_any_json_is_a_report_or_a_clear_error(value: Any) -> None:
    text = json.dumps(value)
    for parser in (parse_amd_smi_static, parse_rocm_smi):
        _reads(parser, text)


@settings(max_examples=200, deadline=None)
@given(
    st.data(),
    st.sampled_from(
        [
            ("asic", "market_name"),
            ("bus", "bdf"),
            ("vram", "size"),
            ("numa", "node"),
            ("driver", "version"),
            ("gpu", None),
            ("asic", None),
            ("vram", None),
        ]
    ),
)
def test_amd_smi_with_any_value_where_one_is_read(
    data: st.DataObject, where: tuple[str, str | None]
) -> None:
    document = json.loads(json.dumps(AMD))
    entry = document[data.draw(st.integers(0, len(document) - 1))]
    section, field = where
    if field is None:
        entry[section] = data.draw(values)
    elif isinstance(entry.get(section), dict):
        entry[section][field] = data.draw(values)
    _reads(parse_amd_smi_static, json.dumps(document))


@settings(max_examples=200, deadline=None)
@given(
    st.data(),
    st.sampled_from(["Card Series", "PCI Bus", "VRAM Total Memory (B)", None]),
)
def test_rocm_smi_with_any_value_where_one_is_read(data: st.DataObject, key: str | None) -> None:
    document = json.loads(json.dumps(ROCM))
    card = f"card{data.draw(st.integers(0, 7))}"
    if key is None:
        document[card] = data.draw(values)
    else:
        document[card][key] = data.draw(values)
    _reads(parse_rocm_smi, json.dumps(document))


READ = [
    "product_name",
    "pci_bus_id",
    "total",
    "product_architecture",
    "current_mig",
    "driver_version",
    "cuda_version",
    "attached_gpus",
    "minor_number",
]


@settings(max_examples=120, deadline=None)
@given(st.sampled_from(READ), st.integers(0, 7), values)
def test_nvidia_smi_with_any_text_where_one_is_read(tag: str, nth: int, value: Any) -> None:
    text = str(value).replace("&", "&amp;").replace("<", "&lt;")
    matches = list(re.finditer(f"<{tag}>[^<]*</{tag}>", H100))
    match = matches[nth % len(matches)]
    _reads(
        parse_nvidia_smi_xml, H100[: match.start()] + f"<{tag}>{text}</{tag}>" + H100[match.end() :]
    )


@settings(max_examples=80, deadline=None)
@given(st.integers(0, len(H100)), st.integers(0, 400), st.text(max_size=20))
def test_nvidia_smi_cut_or_spliced_anywhere(start: int, length: int, insert: str) -> None:
    _reads(parse_nvidia_smi_xml, H100[:start] + insert + H100[start + length :])


@settings(max_examples=300, deadline=None)
@given(values, st.sampled_from([NVIDIA_SMI_UNITS, AMD_SMI_UNITS, BYTES]))
def test_a_memory_size_is_read_or_unknown_and_said(raw: Any, units: dict[str, int]) -> None:
    warnings: list[str] = []
    mib = memory_mib(raw, units, "GPU", warnings)
    assert mib >= 0
    if warnings:  # not understood: unknown, never a guess
        assert mib == 0 and len(warnings) == 1
    else:  # understood: a number in one of the tool's own units
        match = re.fullmatch(r"([0-9.]+)\s*([A-Za-z]*)", str(raw).strip())
        assert match is not None and match.group(2) in units
