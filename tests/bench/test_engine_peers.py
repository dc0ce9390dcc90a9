"""The engine peers' plumbing (``bench/engine_peers/``) with no peer installed: a missing peer
is a stated reason, a runner's result is checked field by field, a runner that fails or
hangs is a stated failure, and the report's ratios and greedy comparison. The real runners
need ``scripts/install_peers.sh`` and run in ``bench/engine_throughput.py --peers``."""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
# The benchmarks import each other as top-level modules, run from bench/.
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))

launcher = importlib.import_module("engine_peers.launcher")
protocol = importlib.import_module("engine_peers.protocol")
report = importlib.import_module("engine_peers.report")

PROMPTS = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
JOB = protocol.Job(
    model="", prompts=PROMPTS, output_tokens=4, num_sequential=2, threads=2, max_model_len=8
)
WAIT_S = 30.0  # a bound on every runner started below


def phase_json(num: int, tokens: list[int] | None = None, **overrides: Any) -> dict[str, Any]:
    completions = [list(tokens or [10, 11, 12, 13]) for _ in range(num)]
    return {
        "tokens_per_s": 100.0,
        "elapsed_s": 0.5,
        "ttft_p50_s": 0.01,
        "ttft_p99_s": 0.02,
        "completions": completions,
        **overrides,
    }


def result_json(**overrides: Any) -> dict[str, Any]:
    return {
        "engine": "fake 1.0",
        "batch": phase_json(3),
        "one_sequence": phase_json(2),
        "notes": ["a note"],
        **overrides,
    }


def fake_peer(tmp_path: Path, runner_body: str, model: str = "model.gguf") -> Any:
    """A peer whose venv's python is this interpreter and whose runner is ``runner_body``
    (given the job and result paths as ``sys.argv[1:3]``), with its model copy in place."""
    peers_dir = tmp_path / "peers"
    (peers_dir / "fake" / "bin").mkdir(parents=True)
    os.symlink(sys.executable, peers_dir / "fake" / "bin" / "python")
    (peers_dir / model).write_text("weights")
    runner = tmp_path / "runner.py"
    runner.write_text(
        "import json, sys, time\njob_path, result_path = sys.argv[1:3]\n" + runner_body
    )
    peer = launcher.Peer(
        name="fake",
        label="Fake",
        venv="fake",
        runner=str(runner),  # absolute, so RUNNER_DIR / runner is runner
        models={"sluice-tiny": model},
    )
    return peer, peers_dir


def run(peer: Any, peers_dir: Path, key: str | None = "sluice-tiny", timeout_s: float = WAIT_S):
    return launcher.run_peer(peer, JOB, key, timeout_s=timeout_s, peers_dir=peers_dir)


def test_peer_without_its_venv_is_reported_not_installed(tmp_path: Path) -> None:
    lines: list[str] = []
    outcome = launcher.run_peer(
        launcher.peer_by_name("vllm"),
        JOB,
        "sluice-tiny",
        timeout_s=5,
        peers_dir=tmp_path,
        log=lines.append,
    )
    assert outcome.result is None
    assert outcome.reason == "not installed (run scripts/install_peers.sh)"
    assert lines == ["vLLM CPU: running ...", f"vLLM CPU: {launcher.NOT_INSTALLED}"]
    assert outcome.figures() == {"missing": launcher.NOT_INSTALLED}


def test_peer_without_its_model_copy_is_reported_not_installed(tmp_path: Path) -> None:
    peer, peers_dir = fake_peer(tmp_path, "")
    (peers_dir / "model.gguf").unlink()
    outcome = run(peer, peers_dir)
    assert outcome.result is None
    assert outcome.reason == f"{launcher.NOT_INSTALLED}: no model.gguf"


def test_peer_is_skipped_for_a_model_it_has_no_copy_of(tmp_path: Path) -> None:
    peer, peers_dir = fake_peer(tmp_path, "raise SystemExit('must not run')")
    outcome = run(peer, peers_dir, key=None)
    assert outcome.result is None
    assert outcome.reason.startswith("skipped: the peers run sluice-tiny and smollm2-135m")


def test_runner_result_is_read_back_with_the_job_it_was_given(tmp_path: Path) -> None:
    body = (
        "job = json.load(open(job_path))\n"
        f"result = {result_json()!r}\n"
        "result['notes'] = [job['model'], str(job['output_tokens'])]\n"
        "json.dump(result, open(result_path, 'w'))\n"
    )
    peer, peers_dir = fake_peer(tmp_path, body)
    outcome = run(peer, peers_dir)
    assert outcome.reason == ""
    assert outcome.result is not None
    assert outcome.result.engine == "fake 1.0"
    assert outcome.result.batch.tokens_per_s == 100.0
    assert outcome.result.one_sequence.completions == [[10, 11, 12, 13]] * 2
    assert outcome.result.notes == [str(peers_dir / "model.gguf"), "4"]
    figures = outcome.figures()
    assert "completions" not in figures["batch"]
    assert figures["one_sequence"]["ttft_p99_s"] == 0.02


def test_runner_that_fails_is_reported_with_the_end_of_its_output(tmp_path: Path) -> None:
    peer, peers_dir = fake_peer(tmp_path, "print('loading'); raise RuntimeError('no kernel')")
    outcome = run(peer, peers_dir)
    assert outcome.result is None
    first, _, rest = outcome.reason.partition("\n")
    assert first == "failed: exit status 1; its output ends:"
    assert "loading" in rest
    assert "RuntimeError: no kernel" in rest


def test_runner_output_that_is_not_a_result_is_a_stated_failure(tmp_path: Path) -> None:
    peer, peers_dir = fake_peer(tmp_path, "open(result_path, 'w').write('[1, 2]')")
    outcome = run(peer, peers_dir)
    assert outcome.result is None
    assert outcome.reason == "failed: its result is invalid: expected an object, got list"


def test_runner_past_its_time_is_killed_with_its_children(tmp_path: Path) -> None:
    """The whole process group goes: a child the runner started (as vLLM starts its engine
    core) is gone too when run_peer returns."""
    pid_file = tmp_path / "child.pid"
    body = (
        "import subprocess\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "print('started', flush=True)\n"
        "time.sleep(60)\n"
    )
    peer, peers_dir = fake_peer(tmp_path, body)
    start = time.monotonic()
    outcome = run(peer, peers_dir, timeout_s=3)
    assert time.monotonic() - start < WAIT_S
    assert outcome.result is None
    assert outcome.reason.startswith("failed: no result within 3 s; its output ends:\nstarted")
    child_pid = int(pid_file.read_text())
    deadline = time.monotonic() + WAIT_S
    while _alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child_pid)


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"engine": ""}, "engine: expected a name"),
        ({"batch": phase_json(2)}, "batch.completions: expected 3 lists, got 2"),
        ({"batch": phase_json(3, [1, 2])}, "batch.completions[0]: 2 tokens, expected 4"),
        ({"batch": phase_json(3, [1, 2, True, 4])}, "batch.completions[0]: expected a list"),
        ({"one_sequence": phase_json(2, tokens_per_s=math.nan)}, "one_sequence.tokens_per_s"),
        ({"one_sequence": phase_json(2, tokens_per_s=0)}, "one_sequence.tokens_per_s: zero"),
        ({"batch": phase_json(3, elapsed_s=-1.0)}, "batch.elapsed_s: negative"),
        ({"batch": phase_json(3, ttft_p50_s="fast")}, "batch.ttft_p50_s: expected a finite"),
        ({"notes": "one"}, "notes: expected a list of strings"),
    ],
)
def test_result_with_a_bad_field_names_it(change: dict[str, Any], message: str) -> None:
    with pytest.raises(protocol.ResultError) as caught:
        protocol.parse_result(json.dumps(result_json(**change)), JOB)
    assert str(caught.value).startswith(message)


def test_result_without_ttft_is_accepted_as_unknown() -> None:
    raw = result_json(batch=phase_json(3, ttft_p50_s=None, ttft_p99_s=None))
    result = protocol.parse_result(json.dumps(raw), JOB)
    assert result.batch.ttft_p50_s is None
    assert result.batch.ttft_p99_s is None


def test_result_round_trips_through_json() -> None:
    result = protocol.parse_result(json.dumps(result_json()), JOB)
    assert protocol.parse_result(result.to_json(), JOB) == result


def test_phase_ttft_is_unknown_unless_every_request_has_one() -> None:
    completions = [[1, 2], [3, 4]]
    assert protocol.make_phase(completions, 2.0, [0.1, None]).ttft_p50_s is None
    phase = protocol.make_phase(completions, 2.0, [0.3, 0.1])
    assert (phase.tokens_per_s, phase.ttft_p50_s, phase.ttft_p99_s) == (2.0, 0.1, 0.3)


def test_run_runner_writes_the_result_or_exits_1_on_an_exception(tmp_path: Path) -> None:
    job_path, result_path = tmp_path / "job", tmp_path / "result"
    job_path.write_text(JOB.to_json())
    result = protocol.parse_result(json.dumps(result_json()), JOB)
    assert (
        protocol.run_runner(
            lambda job: replace(result, notes=[str(job.threads)]), [str(job_path), str(result_path)]
        )
        == 0
    )
    assert protocol.parse_result(result_path.read_text(), JOB).notes == ["2"]

    def broken(job: Any) -> Any:
        raise RuntimeError("engine failed to start")

    result_path.unlink()
    assert protocol.run_runner(broken, [str(job_path), str(result_path)]) == 1
    assert not result_path.exists()


def test_peer_names_are_checked() -> None:
    assert launcher.parse_peer_names("vllm, llama.cpp,") == ["vllm", "llama.cpp"]
    assert launcher.parse_peer_names("") == []
    with pytest.raises(ValueError, match=r"unknown peer 'sglang' \(known: vllm, llama.cpp\)"):
        launcher.parse_peer_names("vllm,sglang")


def test_greedy_agreement_names_where_each_completion_first_differs() -> None:
    ours = [[1, 2, 3], [1, 2, 3], [1, 2, 3]]
    theirs = [[1, 2, 3], [1, 9, 3], [1, 2]]
    assert report.greedy_agreement(ours, theirs) == (
        1,
        ["completion 1 differs from token 1 on", "completion 2 differs from token 2 on"],
    )


def _outcome(name: str, batch_tps: float, single_tps: float, tokens: list[int]) -> Any:
    peer = launcher.peer_by_name(name)
    raw = result_json(
        batch=phase_json(3, tokens, tokens_per_s=batch_tps),
        one_sequence=phase_json(2, tokens, tokens_per_s=single_tps),
    )
    return launcher.PeerOutcome(peer, protocol.parse_result(json.dumps(raw), JOB))


def test_peer_rows_judge_the_issue_targets_and_list_mismatches() -> None:
    ours = report.OursFigures(
        batch_tokens_per_s=1500.0,
        one_sequence_tokens_per_s=300.0,
        hf_batch_tokens_per_s=2000.0,
        batch_completions=[[10, 11, 12, 13]] * 3,
        one_sequence_completions=[[10, 11, 12, 13]] * 2,
    )
    vllm = _outcome("vllm", 3000.0, 150.0, [10, 11, 12, 13])
    llama = _outcome("llama.cpp", 1000.0, 1200.0, [10, 11, 99, 13])
    missing = launcher.PeerOutcome(launcher.peer_by_name("vllm"), None, launcher.NOT_INSTALLED)
    rows, notes = report.peer_rows([vllm, llama, missing], ours)
    by_metric = {metric: (value, target) for metric, value, target in rows}
    assert by_metric["ours / vLLM CPU, all at once"] == ("0.50x", ">= 1.0x: MISS")
    assert by_metric["ours / vLLM CPU, one sequence"] == ("2.00x", "")
    assert by_metric["ours / llama.cpp, all at once"] == ("1.50x", "")
    assert by_metric["ours / llama.cpp, one sequence"] == ("0.25x", ">= 0.5x: MISS")
    assert by_metric["greedy completions equal to vLLM CPU"] == ("3 of 3", "")
    assert by_metric["greedy completions equal to llama.cpp one sequence"] == ("0 of 2", "")
    assert by_metric["vLLM CPU"] == (launcher.NOT_INSTALLED, "")
    assert "llama.cpp: completion 0 differs from token 2 on" in notes
    table = report.summary_table([vllm, llama, missing], ours, 64)
    assert "| in-process, 64 at once | 1,500 | 3,000 | 1,000 | n/a | 2,000 |" in table
    assert "| in-process, one sequence | 300 | 150 | 1,200 | n/a | - |" in table


def test_peer_rows_pass_when_the_targets_are_met() -> None:
    ours = report.OursFigures(3100.0, 700.0, 2000.0, [[10, 11, 12, 13]] * 3, [[10, 11, 12, 13]] * 2)
    rows, _ = report.peer_rows(
        [
            _outcome("vllm", 3000.0, 150.0, [10, 11, 12, 13]),
            _outcome("llama.cpp", 1000.0, 1200.0, [10, 11, 12, 13]),
        ],
        ours,
    )
    targets = {metric: target for metric, _, target in rows if target}
    assert targets == {
        "ours / vLLM CPU, all at once": ">= 1.0x: PASS",
        "ours / llama.cpp, one sequence": ">= 0.5x: PASS",
    }


def test_foreign_cpu_is_unknown_without_linux_proc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(protocol.ForeignCpu, "STAT", tmp_path / "absent")
    assert protocol.ForeignCpu().cores() is None


def test_foreign_cpu_is_the_machine_less_this_process_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Machine busy 3 s of CPU (idle and iowait excluded) over 2 s of wall time, of which
    the process 10 and its child 11 used 1 s: the other jobs used 1 core."""
    tick = os.sysconf("SC_CLK_TCK")
    stat, proc = tmp_path / "stat", tmp_path / "proc"

    def machine(busy_s: float, tree_s: tuple[float, float]) -> None:
        # user nice system idle iowait irq softirq steal
        stat.write_text(f"cpu  {int(busy_s * tick)} 0 0 5000 70 0 0 0 0 0\ncpu0 0\n")
        for pid, seconds, children in ((10, tree_s[0], "11"), (11, tree_s[1], "")):
            (proc / str(pid) / "task" / str(pid)).mkdir(parents=True, exist_ok=True)
            ticks = int(seconds * tick)
            fields = ["S", *["0"] * 10, str(ticks), "0", *["0"] * 30]
            (proc / str(pid) / "stat").write_text(f"{pid} (python3 (x)) {' '.join(fields)}")
            (proc / str(pid) / "task" / str(pid) / "children").write_text(children)

    monkeypatch.setattr(protocol.ForeignCpu, "STAT", stat)
    monkeypatch.setattr(protocol.ForeignCpu, "PROC", proc)
    clock = iter([100.0, 102.0])
    monkeypatch.setattr(protocol.time, "monotonic", lambda: next(clock, 102.0))
    machine(10.0, (1.0, 2.0))
    meter = protocol.ForeignCpu(pid=10)
    machine(13.0, (1.5, 2.5))
    assert meter.cores() == pytest.approx(1.0)


def test_busy_cores_reads_the_machine_wide_idle_share(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 100 800 0 0 0 0 0 0\ncpu0 1 2 3\n")
    assert launcher.busy_cores(0.0, stat) == 0.0  # nothing elapsed: no reading to go on


def test_wait_for_quiet_gives_up_after_its_bound_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    readings = iter([1.5, 1.2, 1.1, 1.0, 0.9])
    monkeypatch.setattr(launcher, "busy_cores", lambda window_s: next(readings))
    lines: list[str] = []
    assert launcher.wait_for_quiet(0.0, "ours", log=lines.append) == 1.5
    assert lines == ["ours: the machine is still busy (1.50 cores) after 0 s"]
    readings = iter([1.5, 0.1])
    monkeypatch.setattr(launcher, "busy_cores", lambda window_s: next(readings))
    assert launcher.wait_for_quiet(60.0, "ours", log=lines.append) == 0.1
    assert len(lines) == 1
