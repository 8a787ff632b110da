"""Standing fault suite, part 5: the ``dew-pipe plot`` and ``dew-pipe audit`` sub-commands and
the stage chain (``pipelines/chain.py``, ``recipes.chain``).

Each case gives one bad input and checks that the command ends with one line on stderr that
names the thing at fault, with the documented exit status (2: a missing path or a refused
setting; 1: bad data, or a chain that fails), that it leaves no thread behind and writes no
half output. None of these can hang, so they run in this process through ``cli.main``.
"""

from __future__ import annotations

import json
import threading

import pytest
from fault_helpers import ROOT, files_under, one_line

from dew_pipe.beam import session_to_json
from dew_pipe.cli import load_file, main
from dew_pipe.data.tokenizer import build_tokenizer
from dew_pipe.objectives.rl.sessions import Call, Session

TINY = ["digits=1", "conversations=20", "pairs=8", "prompts=8", "test_size=4", "batch=4"]


def _session_line(**changes) -> str:
    session = Session(0, 0, 0, 0, [Call([1, 2], [3], [-0.5], "stop", 0)], "COMPLETED", 1.0)
    return json.dumps({**session_to_json(session), **changes})


def _metrics(folder, text):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text(text)
    return folder


def _plot_case(case, tmp_path):
    run = tmp_path / "run"
    if case == "missing run":
        return ["plot", str(tmp_path / "nowhere")], 2, "nowhere: no such run directory"
    if case == "empty metrics":
        _metrics(run, "")
        return ["plot", str(run)], 1, "metrics.jsonl is empty"
    if case == "malformed line":
        _metrics(run, '{"step": 1, "loss": 2.0}\n{"step": 2, "loss"\n')
        return ["plot", str(run)], 1, "metrics.jsonl line 2 is not JSON"
    if case == "nothing to plot":
        _metrics(run, '{"kind": "event", "message": "started"}\n')
        return ["plot", str(run)], 1, "no loss, reward, accuracy, lag, queue wait records"
    _metrics(run, '{"step": 1, "loss": 2.0}\n')  # "missing output folder"
    out = tmp_path / "no" / "curves.png"
    return ["plot", str(run), "--output", str(out)], 2, "the folder"


def _audit_case(case, tmp_path):
    if case == "missing tokenizer":
        return ["audit", "template", "--tokenizer", str(tmp_path / "tok")], 2, "no such directory"
    if case == "tokenizer without template":
        tokenizer = build_tokenizer(["a b c d"] * 8, vocab_size=300)
        tokenizer.chat_template = None
        tokenizer.save_pretrained(tmp_path / "tok")
        return ["audit", "template", "--tokenizer", str(tmp_path / "tok")], 2, "no chat template"
    traces = tmp_path / "traces.jsonl"
    if case == "missing traces":
        return ["audit", "sessions", str(traces)], 2, "traces.jsonl: no such file"
    bad = {"traces not JSON": "{oops", "traces bad session": _session_line(status="DONE"),
           "traces bad calls": _session_line(calls={"prompt_ids": [1]})}[case]  # fmt: skip
    traces.write_text(_session_line() + "\n" + bad + "\n")
    return ["audit", "sessions", str(traces)], 1, "traces.jsonl line 2"


PLOT_CASES = ["missing run", "empty metrics", "malformed line", "nothing to plot",
              "missing output folder"]  # fmt: skip
AUDIT_CASES = ["missing tokenizer", "tokenizer without template", "missing traces",
               "traces not JSON", "traces bad session", "traces bad calls"]  # fmt: skip


@pytest.mark.parametrize("case", PLOT_CASES + AUDIT_CASES)
def test_plot_and_audit_faults_are_one_line(case, tmp_path, capsys):
    build = _plot_case if case in PLOT_CASES else _audit_case
    argv, code, message = build(case, tmp_path)
    before = files_under(tmp_path)
    threads = threading.active_count()
    assert main(argv) == code
    err = capsys.readouterr().err
    line = one_line(err)
    assert line.startswith("dew-pipe: ") and message in line, line
    assert files_under(tmp_path) == before  # no PNG, no temporary file left
    assert threading.active_count() == threads


def test_a_chain_output_started_with_other_settings_is_refused(tmp_path, capsys):
    output = tmp_path / "chain"
    output.mkdir()
    chain = load_file(ROOT / "pipelines" / "chain.py")
    started = chain.pipeline(
        output=output, **{k: int(v) for k, v in (kv.split("=") for kv in TINY)}
    )
    (output / "settings.json").write_text(json.dumps(started._plain_settings()))
    sets = [f"--set={kv}" for kv in (f"output={output}", "seed=3", *TINY)]
    assert main(["run", "pipelines/chain.py", "--run-dir", str(tmp_path / "run"), *sets]) == 2
    line = one_line(capsys.readouterr().err)
    assert f"output {output} holds a chain started with seed=0 (now 3); expected" in line
    assert "--set output=DIR" in line
    assert not (tmp_path / "run").exists()  # refused before the run began


def test_a_chain_whose_stage_directory_holds_another_stage_fails_naming_it(tmp_path, capsys):
    output = tmp_path / "chain"
    (output / "sft").mkdir(parents=True)
    (output / "sft" / "stage.json").write_text(
        json.dumps({"stage": "sft", "index": 0, "objective": "dpo"})
    )
    sets = [f"--set={kv}" for kv in (f"output={output}", *TINY)]
    assert main(["run", "pipelines/chain.py", "--run-dir", str(tmp_path / "run"), *sets]) == 1
    line = one_line(capsys.readouterr().err)
    assert "holds" in line and "not stage 'sft' (index 0, sft)" in line
    assert not (output / "sft" / "checkpoints").exists()  # nothing trained into it
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "failed"


def test_a_chain_setting_out_of_range_is_refused(tmp_path, capsys):
    sets = ["--set=dpo_steps=0", f"--set=output={tmp_path / 'chain'}"]
    assert main(["run", "pipelines/chain.py", "--run-dir", str(tmp_path / "run"), *sets]) == 2
    line = one_line(capsys.readouterr().err)
    assert "dpo_steps is 0; expected an int >= 1" in line
    assert not (tmp_path / "chain").exists()
