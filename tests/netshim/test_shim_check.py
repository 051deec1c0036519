"""The self-test (G10.3, G20): nodus-shim-check runs a launcher with the shim preloaded and
proves it loaded; static and musl launchers are ShimNotLoaded, with why and what to do."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from libs import netshim
from tests.conftest import left_when_cancelled
from tests.netshim.support import PROGRAMS, clean_env

pytestmark = pytest.mark.timeout(60)

ADVICE = "or set transport: Direct"


def check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(netshim.CHECK_PATH), *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(),
        check=False,
    )


@pytest.mark.parametrize(
    "launcher",
    [
        [str(PROGRAMS / "hello-glibc")],
        ["/bin/sh", "-c", "true"],
        [sys.executable, "-c", "pass"],
    ],
    ids=["glibc-binary", "sh", "python"],
)
def test_glibc_launchers_load_the_shim(shim: Path, launcher: list[str]) -> None:
    result = netshim.self_test(launcher)
    assert result.ok, result.message
    assert result.exit_code == netshim.EXIT_LOADED
    assert result.reason is None
    assert result.loaded
    assert result.linkage == "glibc"
    assert result.interpreter is not None and "ld-linux" in result.interpreter
    assert result.shim == str(netshim.SHIM_PATH)
    assert result.markers and all(m.startswith("pid=") for m in result.markers)


def test_static_binary_is_shim_not_loaded(shim: Path) -> None:
    result = netshim.self_test([str(PROGRAMS / "hello-static")])
    assert not result.ok
    assert result.reason == netshim.SHIM_NOT_LOADED
    assert result.exit_code == netshim.EXIT_NOT_LOADED
    assert result.linkage == "static"
    assert result.interpreter is None
    assert not result.loaded and result.markers == []
    assert "statically linked (no PT_INTERP" in result.message
    assert "glibc-based image" in result.message and ADVICE in result.message

    done = check(str(PROGRAMS / "hello-static"))  # the human form and the exit status
    assert done.returncode == 1
    assert done.stdout.startswith("ShimNotLoaded: ")


@pytest.fixture
def musl(shim: Path) -> Path:
    if shutil.which("musl-gcc") is None:
        pytest.skip("musl-gcc is not installed (Debian musl-tools; make system-deps)")
    return PROGRAMS


def test_musl_binary_is_shim_not_loaded(musl: Path) -> None:
    result = netshim.self_test([str(musl / "hello-musl")])
    assert not result.ok
    assert result.reason == netshim.SHIM_NOT_LOADED
    assert result.exit_code == netshim.EXIT_NOT_LOADED
    assert result.linkage == "musl"
    assert result.interpreter is not None and "ld-musl" in result.interpreter
    assert "linked against musl" in result.message and ADVICE in result.message
    # musl's loader tries the library and cannot relocate it (glibc-only symbols); had it
    # managed, the check would still refuse: the shim is qualified on glibc only (G20).
    assert not result.loaded
    assert result.loader_message is not None and "symbol not found" in result.loader_message
    assert result.loader_message in result.message


def test_static_musl_binary_is_shim_not_loaded(musl: Path) -> None:
    result = netshim.self_test([str(musl / "hello-musl-static")])
    assert (result.ok, result.reason, result.linkage) == (False, "ShimNotLoaded", "static")


def test_script_launchers_are_judged_by_their_interpreter(musl: Path, tmp_path: Path) -> None:
    script = tmp_path / "entrypoint"
    script.write_text(f"#!{musl / 'hello-musl'}\n")
    script.chmod(0o755)
    result = netshim.self_test([str(script)])
    assert result.target == str(musl / "hello-musl")
    assert (result.ok, result.linkage) == (False, "musl")

    # `#!/usr/bin/env NAME` is followed to NAME in PATH.
    script.write_text("#!/usr/bin/env hello-glibc\n")
    env = clean_env()
    env["PATH"] = f"{PROGRAMS}:{env.get('PATH', '/usr/bin:/bin')}"
    result = netshim.self_test([str(script)], env=env)
    assert result.target == str(PROGRAMS / "hello-glibc")
    assert result.ok, result.message


def test_the_image_ld_preload_follows_the_shim(shim: Path, tmp_path: Path) -> None:
    seen = tmp_path / "preload"
    image_lib = "/lib/x86_64-linux-gnu/libm.so.6"
    if not os.path.exists(image_lib):
        pytest.skip(f"{image_lib} is not on this machine")
    env = clean_env()
    env["LD_PRELOAD"] = image_lib
    result = netshim.self_test(["/bin/sh", "-c", f'printf %s "$LD_PRELOAD" > {seen}'], env=env)
    assert result.ok, result.message
    assert seen.read_text().split(":") == [str(netshim.SHIM_PATH), image_lib]


def test_children_of_the_launcher_load_it_too(shim: Path) -> None:
    result = netshim.self_test(["/bin/sh", "-c", "/bin/sh -c true; true"])
    assert result.ok
    assert len(result.markers) == 2  # the launcher and its child, one line each


def test_a_launcher_that_hangs_is_killed_and_still_proves_the_load(shim: Path) -> None:
    result = netshim.self_test(["sleep", "30"], timeout=1)
    assert result.ok
    assert result.launcher_status == "killed after 1s"


def test_config_problems_are_in_the_marker(shim: Path) -> None:
    env = clean_env()
    env["NODUS_NETSHIM_PEERS"] = "127.0.0.2,not-an-ip"
    result = netshim.self_test(["/bin/sh", "-c", "true"], env=env)
    assert result.ok
    assert "config=NODUS_NETSHIM_PEERS: 'not-an-ip' is not an IP literal" in result.markers[0]


def test_check_failures_and_usage(shim: Path, tmp_path: Path) -> None:
    result = netshim.self_test(["/nonexistent/launcher"])
    assert (result.ok, result.reason, result.exit_code) == (False, "CheckFailed", 3)
    assert "not found" in result.message

    result = netshim.self_test(["/bin/sh"], shim=tmp_path / "missing.so")
    assert (result.reason, result.exit_code) == ("CheckFailed", 3)

    assert check().returncode == 2
    assert check("--bogus", "/bin/sh").returncode == 2
    assert check("--help").returncode == 0


async def test_async_self_test(shim: Path) -> None:
    result = await netshim.self_test_async([str(PROGRAMS / "hello-static")])
    assert result.reason == netshim.SHIM_NOT_LOADED
    result = await netshim.self_test_async(["/bin/sh", "-c", "true"])
    assert result.ok


async def test_a_self_test_cancelled_leaves_no_process_behind(shim: Path) -> None:
    # The agent stopping while a launcher's self-test runs: the check is killed and reaped.
    check = netshim.self_test_async(["/bin/sh", "-c", "sleep 30"])
    assert await left_when_cancelled(check) == set()
