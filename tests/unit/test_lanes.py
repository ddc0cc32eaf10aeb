"""``make test``'s runner reads each session's output: its counts, and the failed tests it names again
at the end with their error lines (a log read from its tail must show them and why)."""

from __future__ import annotations

import io
import json
import signal
import threading
from collections import Counter, deque
from collections.abc import Iterator
from pathlib import Path

from tests import lanes
from tests.lanes import LANES, Lane, relay

SESSION = """\
tests/unit/test_a.py::test_one PASSED                                    [ 50%]
tests/unit/test_a.py::test_two FAILED                                    [100%]
=================================== FAILURES ===================================
___________________________________ test_two ___________________________________

    def test_two() -> None:
>       assert done.returncode == 0, done.stderr
E       AssertionError:
E         Traceback (most recent call last):
E         RuntimeError: a rank failed
E       assert 1 == 0
_ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _
E       RuntimeError: raised below
_ test_a_name_so_long_that_pytest_leaves_one_underscore_each_side_of_it[with-a-parameter] _
E       ValueError: a second test
___________________________________ test_two ___________________________________
E       KeyError: another file's test_two
------------------------------ Captured log call -------------------------------
ERROR    fp8rl.serving:serving.py:79 internal error
ERROR 12-06 10:00:00 [core.py:1] an engine's own log line
=========================== short test summary info ============================
FAILED tests/unit/test_a.py::test_two - AssertionError: assert 1 == 2
ERROR tests/unit/test_b.py::test_three - RuntimeError: no server
============== 1 failed, 1 passed, 1 skipped, 1 error in 2.50s ===============
"""


def test_relay_counts_the_closing_line_and_keeps_the_failed_tests(capsys) -> None:
    counts: Counter[str] = Counter()
    failures: list[str] = []
    errors: list[tuple[str, deque[str]]] = []
    relay(LANES[1], io.StringIO(SESSION), threading.Lock(), counts, failures, errors)

    assert counts == Counter(failed=1, passed=1, skipped=1, error=1)
    assert failures == [
        "[rest] FAILED tests/unit/test_a.py::test_two - AssertionError: assert 1 == 2",
        "[rest] ERROR tests/unit/test_b.py::test_three - RuntimeError: no server",
    ]
    assert [(test, list(lines)) for test, lines in errors] == [
        (
            "[rest] test_two",
            [
                "E       AssertionError:",
                "E         Traceback (most recent call last):",
                "E         RuntimeError: a rank failed",
                "E       assert 1 == 0",
                "E       RuntimeError: raised below",
            ],
        ),
        (
            "[rest] test_a_name_so_long_that_pytest_leaves_one_underscore_each_side_of_it[with-a-parameter]",
            ["E       ValueError: a second test"],
        ),
        ("[rest] test_two", ["E       KeyError: another file's test_two"]),
    ]
    copied = capsys.readouterr().out.splitlines()
    assert copied == [f"[rest] {line}" for line in SESSION.splitlines()]


def test_each_lane_keeps_its_own_reports_error_lines_while_the_other_lane_reports_too() -> None:
    errors: list[tuple[str, deque[str]]] = []
    lock = threading.Lock()

    def rest_lane() -> Iterator[str]:
        yield "=================================== FAILURES ===================================\n"
        yield "_________________________________ test_rest _________________________________\n"
        # (the end-to-end lane reports a failure of its own in between)
        e2e = "= FAILURES =\n____ test_e2e ____\nE       e2e's error\n"
        relay(LANES[0], io.StringIO(e2e), lock, Counter(), [], errors)
        yield "E       rest's error\n"

    relay(LANES[1], rest_lane(), lock, Counter(), [], errors)
    assert [(test, list(lines)) for test, lines in errors] == [
        ("[rest] test_rest", ["E       rest's error"]),
        ("[e2e] test_e2e", ["E       e2e's error"]),
    ]


SCRATCH_TEST = """\
import json, os, tempfile
from pathlib import Path

def test_leaves_a_file_in_its_scratch():
    scratch = Path(tempfile.gettempdir())
    (scratch / "left-behind").write_text("as a killed process leaves its socket")
    seen = {{"scratch": str(scratch), "inductor": os.environ["TORCHINDUCTOR_CACHE_DIR"]}}
    Path({record!r}).write_text(json.dumps(seen))
"""


def test_each_lane_has_a_scratch_tmpdir_of_its_own_removed_with_the_root(tmp_path, monkeypatch) -> None:
    selected = []
    for name in ("one", "two"):
        test = tmp_path / f"test_{name}_scratch.py"
        test.write_text(SCRATCH_TEST.format(record=str(tmp_path / f"{name}.record")))
        selected.append(Lane(name, (str(test), "-p", "no:cacheprovider")))
    monkeypatch.setattr(lanes, "LANES", tuple(selected))
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert lanes.run([]) == 0
    finally:  # (the runner takes over both signals for its sessions)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)

    seen = [json.loads((tmp_path / f"{name}.record").read_text()) for name in ("one", "two")]
    scratches = [Path(s["scratch"]) for s in seen]
    assert [s.name for s in scratches] == ["one-tmp", "two-tmp"]
    root = scratches[0].parent
    assert scratches[1].parent == root and root.name.startswith("fp8rl-tests-")  # (one root, the runner's)
    assert not root.exists()  # (the lanes passed: the root went, with what was left in it)
    # (compiled kernels stay in the machine's cache, shared by both lanes and by runs to come)
    assert seen[0]["inductor"] == seen[1]["inductor"] == lanes.inductor_cache()
    assert not Path(seen[0]["inductor"]).is_relative_to(root)


def test_the_lanes_run_every_test_file_once_and_move_files_that_exist() -> None:
    """Each e2e file in exactly one lane (a renamed file named in E2E_BESIDE_THE_REST would move back)."""
    e2e, rest = LANES
    files = {file.relative_to(lanes.ROOT).as_posix() for file in lanes.files_pytest_collects(lanes.E2E)}
    assert "tests/e2e/test_chaos.py" in files and "tests/e2e/test_ray_run.py" in files
    ignored = {lane.name: {a.removeprefix("--ignore=") for a in lane.selection[1:]} for lane in LANES}
    assert e2e.selection[0] == "tests/e2e" and rest.selection[0] == "tests"
    assert ignored["e2e"] | ignored["rest"] == files and not ignored["e2e"] & ignored["rest"]
    assert {Path(f).name for f in ignored["e2e"]} == set(lanes.E2E_BESIDE_THE_REST)
