"""ChatMessages: roles from chat templates, checked against transformers/TRL, packing, errors."""

from __future__ import annotations

import doctest
import json
import sys
import types
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from dew_pipe.data import Loading
from dew_pipe.data.chat import ChatMessages, Role, tokenize_conversation
from dew_pipe.data.dataset import Partition
from dew_pipe.data.packing import RowBatches, first_fit, pack_documents

FIXTURES = Path(__file__).parent / "parity" / "fixtures"
RECORDED = json.loads((FIXTURES / "chat_masks.json").read_text(encoding="utf-8"))
TOKENIZER_DIR = FIXTURES / RECORDED["tokenizer"]

QA = [
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Four."},
]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8")
    return path


@pytest.fixture(scope="module")
def recorded_tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


# --- parity with transformers' apply_chat_template(return_assistant_tokens_mask=True) ---------


def _check_recorded(data: ChatMessages, cases: list[dict]) -> None:
    tokenized = data.tokenized()
    assert len(tokenized) == len(cases)
    for index, ((ids, roles), case) in enumerate(zip(tokenized, cases, strict=True)):
        assert ids.tolist() == case["ids"], f"ids of case {index}"
        mask = (roles == Role.ASSISTANT).astype(int).tolist()
        assert mask == case["assistant_masks"], f"assistant mask of case {index}"


def test_chatml_matches_recorded_ids_and_assistant_masks(tmp_path):
    cases = RECORDED["chatml"]["cases"]
    assert all(RECORDED["chatml"]["checks"][k] for k in ("prefix_preserving", "stop_token_trained"))
    rows = [{"messages": c["messages"], "tools": c.get("tools")} for c in cases]
    data = ChatMessages(str(TOKENIZER_DIR), _jsonl(tmp_path / "c.jsonl", rows), seq_len=511)
    _check_recorded(data, cases)


def test_parquet_with_json_string_columns_matches_recorded(tmp_path):
    cases = RECORDED["chatml"]["cases"]
    table = pa.table(
        {
            "messages": [json.dumps(c["messages"]) for c in cases],
            "tools": [None if "tools" not in c else json.dumps(c["tools"]) for c in cases],
        }
    )
    pq.write_table(table, tmp_path / "c.parquet")
    data = ChatMessages(TOKENIZER_DIR, tmp_path / "c.parquet", seq_len=511)
    _check_recorded(data, cases)
    # Native nested columns: Parquet fills fields a struct lacks with nulls, which are dropped.
    native = [cases[0], cases[2]]
    table = pa.table(
        {"messages": [c["messages"] for c in native], "tools": [None, cases[2]["tools"]]}
    )
    pq.write_table(table, tmp_path / "native.parquet")
    _check_recorded(ChatMessages(TOKENIZER_DIR, tmp_path / "native.parquet", seq_len=511), native)


def test_second_template_matches_recorded(tmp_path, recorded_tokenizer):
    plain = RECORDED["plain"]
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    tokenizer.chat_template = plain["chat_template"]
    rows = [{"messages": c["messages"]} for c in plain["cases"]]
    data = ChatMessages(tokenizer, _jsonl(tmp_path / "p.jsonl", rows), seq_len=255)
    _check_recorded(data, plain["cases"])
    ids, roles = data.tokenized()[0]
    assert ids[0] == tokenizer.bos_token_id and roles[0] == Role.USER  # preamble: first message


def test_roles_of_every_message_kind(recorded_tokenizer):
    tok = recorded_tokenizer
    case = RECORDED["chatml"]["cases"][2]  # system, user, assistant+tool call, tool, assistant
    ids, roles = tokenize_conversation(tok, case["messages"], case["tools"])
    spans = []  # (role, decoded text) of each run of equal roles
    start = 0
    for i in range(1, len(roles) + 1):
        if i == len(roles) or roles[i] != roles[start]:
            spans.append((Role(int(roles[start])), tok.decode(ids[start:i])))
            start = i
    assert [r for r, _ in spans] == [
        Role.SYSTEM, Role.USER, Role.NONE, Role.ASSISTANT, Role.TOOL, Role.NONE, Role.ASSISTANT
    ]  # fmt: skip
    assert spans[0][1].startswith("<|im_start|>system\nUse tools when they help.\n\n# Tools")
    assert '"name": "add"' in spans[0][1]
    assert spans[1][1] == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
    assert spans[2][1] == spans[5][1] == "<|im_start|>assistant\n"
    assert (
        spans[3][1]
        == '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>\n'
    )
    assert spans[4][1] == "<|im_start|>tool\n5<|im_end|>\n"
    assert spans[6][1] == "2 + 3 is 5.<|im_end|>\n"


def test_verl_prompt_column(tmp_path):
    rows = [{"prompt": QA, "data_source": "x"}, {"messages": QA}]
    data = ChatMessages(TOKENIZER_DIR, _jsonl(tmp_path / "v.jsonl", rows), seq_len=63)
    (a_ids, a_roles), (b_ids, b_roles) = data.tokenized()
    assert a_ids.tolist() == b_ids.tolist() and a_roles.tolist() == b_roles.tolist()
    pq.write_table(pa.table({"prompt": [QA, QA]}), tmp_path / "v.parquet")  # list<struct>
    parquet = ChatMessages(TOKENIZER_DIR, tmp_path / "v.parquet", seq_len=63).tokenized()
    assert [x[0].tolist() for x in parquet] == [a_ids.tolist()] * 2


# --- packing and batches ------------------------------------------------------------------------


def _conversations(n: int) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        turns = []
        for t in range(int(rng.integers(1, 3))):
            turns += [
                {
                    "role": "user",
                    "content": f"Question {i}.{t}: " + "why " * int(rng.integers(1, 4)),
                },
                {"role": "assistant", "content": "Because " * int(rng.integers(1, 4))},
            ]
        rows.append({"messages": turns})
    return rows


def test_packed_rows_hold_every_conversation_exactly(tmp_path):
    path = _jsonl(tmp_path / "many.jsonl", _conversations(40))
    spec = ChatMessages(TOKENIZER_DIR, path, seq_len=127, shuffle=False)
    data = spec.load(batch=4)
    docs = spec.tokenized()
    assert data.records == spec.stats["train"]["rows"] < 40 and data.batch == 4
    train = data.train(Partition(0, 1))
    batches = [next(train) for _ in range(-(-data.records // 4))]
    for b in batches:
        assert b["text"].shape == b["text_roles"].shape == (4, 128)
        assert b["text"].dtype == np.int32 and b["text_roles"].dtype == np.int8
        assert b["text_segment_ids"].dtype == b["text_positions"].dtype == np.int32
    # Unshuffled, the stream visits rows 0..records-1 once, then wraps around.
    rows = {k: np.concatenate([b[k] for b in batches])[: data.records] for k in batches[0]}
    seen = []
    fields = ("text", "text_roles", "text_segment_ids", "text_positions")
    for text, roles, seg, pos in zip(*(rows[k] for k in fields), strict=True):
        pad = seg == 0
        assert (
            np.all(text[pad] == spec.pad_id) and np.all(roles[pad] == 0) and np.all(pos[pad] == 0)
        )
        assert not pad.any() or pad[np.argmax(pad) :].all()  # padding only at the end
        for s in np.unique(seg[~pad]):
            where = seg == s
            assert pos[where].tolist() == list(range(where.sum()))
            seen.append((tuple(text[where].tolist()), tuple(roles[where].tolist())))
    assert sorted(seen) == sorted((tuple(i.tolist()), tuple(r.tolist())) for i, r in docs)
    stats = spec.stats["train"]
    assert stats["conversations"] == 40 and stats["tokens"] == sum(len(i) for i, _ in docs)
    assert stats["fill"] == pytest.approx(stats["tokens"] / (stats["rows"] * 128))
    assert stats["truncated"] == stats["without_assistant"] == 0


def test_first_fit_against_brute_force_rule():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 11, size=200).tolist()
    rows = first_fit(lengths, 10)
    assert sorted(d for row in rows for d in row) == list(range(200))
    free: list[int] = []  # replay the rule naively: longest first, earliest row with room
    placed: list[list[int]] = []
    for doc in sorted(range(200), key=lambda i: (-lengths[i], i)):
        row = next((r for r, f in enumerate(free) if f >= lengths[doc]), len(free))
        if row == len(free):
            free.append(10)
            placed.append([])
        free[row] -= lengths[doc]
        placed[row].append(doc)
    assert rows == placed
    with pytest.raises(ValueError, match=r"lengths\[0\] is 11; expected a length in \[1, 10\]"):
        first_fit([11], 10)
    with pytest.raises(ValueError, match="document 0 has 2 tokens but 1 roles"):
        pack_documents([np.array([1, 2])], [np.array([1])], 4)


def test_row_batches_partition_resume_and_epochs():
    rows = {"x": np.arange(10)[:, None]}
    whole = RowBatches(rows, 4, Partition(0, 1), seed=3)
    firsts = [next(whole)["x"].ravel() for _ in range(6)]
    halves = [RowBatches(rows, 4, Partition(i, 2), seed=3) for i in range(2)]
    for b in firsts:
        assert np.concatenate([next(h)["x"].ravel() for h in halves]).tolist() == b.tolist()
    stream = np.concatenate(firsts)
    assert sorted(stream[:10].tolist()) == list(range(10))  # each epoch visits every row once
    assert sorted(stream[10:20].tolist()) == list(range(10))
    assert stream[:10].tolist() != stream[10:20].tolist()  # reshuffled per epoch
    resumed = RowBatches(rows, 4, Partition(0, 1), seed=3)
    resumed.set_state({"next_batch": 3})
    assert next(resumed)["x"].ravel().tolist() == firsts[3].tolist()
    assert resumed.get_state() == {"next_batch": 4}
    with pytest.raises(ValueError, match="next_batch"):
        resumed.set_state({"next_batch": -1})
    with pytest.raises(ValueError, match="batch=4 does not divide among 3 processes"):
        RowBatches(rows, 4, Partition(0, 3))


def test_val_path_batches_cover_once_with_padding_rows(tmp_path):
    train = _jsonl(tmp_path / "t.jsonl", _conversations(6))
    val = _jsonl(tmp_path / "v.jsonl", _conversations(5))
    spec = ChatMessages(TOKENIZER_DIR, train, seq_len=127, val_path=val)
    data = spec.load(batch=4)
    batches = list(data.val(Partition(0, 1)))
    rows = spec.stats["val"]["rows"]
    assert len(batches) == -(-rows // 4)
    text = np.concatenate([b["text_segment_ids"] for b in batches])
    assert (text != 0).any(axis=1).sum() == rows  # real rows, then all-padding rows
    assert spec.stats["val"]["conversations"] == 5
    assert ChatMessages(TOKENIZER_DIR, train, seq_len=127).load(batch=4).val is None


def test_loading_threads_and_processes_give_the_same_rows(tmp_path):
    path = _jsonl(tmp_path / "many.jsonl", _conversations(40))
    base = ChatMessages(TOKENIZER_DIR, path, seq_len=127).tokenized()
    for loading in (Loading(threads=2), Loading(workers=1, read_buffer=1)):
        other = ChatMessages(TOKENIZER_DIR, path, seq_len=127, loading=loading).tokenized()
        assert [(a.tolist(), b.tolist()) for a, b in other] == [
            (a.tolist(), b.tolist()) for a, b in base
        ]


# --- errors ---------------------------------------------------------------------------------------

NOT_APPEND_ONLY = (  # drops the content of every assistant turn but the last, like reasoning strips
    "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' -}}"
    "{%- if m.role != 'assistant' or loop.last -%}{{- m.content -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def test_tokenizer_without_chat_template_is_refused(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="has no chat template; expected one"):
        ChatMessages(tokenizer, tmp_path / "x.jsonl", seq_len=8)


def test_template_that_rewrites_history_names_the_row(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    tokenizer.chat_template = NOT_APPEND_ONLY
    rows = [{"messages": QA}, {"messages": QA + [{"role": "user", "content": "More?"}]}]
    spec = ChatMessages(tokenizer, _jsonl(tmp_path / "h.jsonl", rows), seq_len=63)
    with pytest.raises(ValueError, match=r"row 1 of .*h\.jsonl.*not append-only: message 2"):
        spec.load(batch=2)


def test_assistant_first_conversation_names_the_row(tmp_path):
    rows = [{"messages": QA}, {"messages": QA[::-1]}]
    spec = ChatMessages(TOKENIZER_DIR, _jsonl(tmp_path / "a.jsonl", rows), seq_len=63)
    with pytest.raises(ValueError, match=r"row 1 .* starts with a 'assistant' message; expected"):
        spec.tokenized()
    tool_first = [{"messages": [{"role": "tool", "content": "4"}]}]
    with pytest.raises(ValueError, match="row 0 .* starts with a 'tool' message"):
        ChatMessages(TOKENIZER_DIR, _jsonl(tmp_path / "t.jsonl", tool_first), seq_len=9).tokenized()
    odd = [{"messages": [{"role": "narrator", "content": "x"}]}]
    with pytest.raises(ValueError, match="message 0 has role 'narrator'; expected one of"):
        ChatMessages(TOKENIZER_DIR, _jsonl(tmp_path / "n.jsonl", odd), seq_len=9).tokenized()


def test_missing_column_names_it(tmp_path):
    path = _jsonl(tmp_path / "m.jsonl", [{"conversation": QA}])
    with pytest.raises(
        ValueError,
        match=r"no column 'messages' \(nor verl's 'prompt'\); columns are \['conversation'\]",
    ):
        ChatMessages(TOKENIZER_DIR, path, seq_len=63).tokenized()
    pq.write_table(pa.table({"chat": [json.dumps(QA)]}), tmp_path / "m.parquet")
    with pytest.raises(ValueError, match=r"no column 'messages' .*columns are \['chat'\]"):
        ChatMessages(TOKENIZER_DIR, tmp_path / "m.parquet", seq_len=63).tokenized()
    assert ChatMessages(TOKENIZER_DIR, tmp_path / "m.parquet", 63, column="chat").tokenized()
    mixed = _jsonl(tmp_path / "mixed.jsonl", [{"messages": QA}, {"other": 1}])
    with pytest.raises(ValueError, match=r"row 1 \(line 2\) .* has no 'messages' value"):
        ChatMessages(TOKENIZER_DIR, mixed, seq_len=63).tokenized()


def test_empty_files_are_refused(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="holds no conversations; expected at least one row"):
        ChatMessages(TOKENIZER_DIR, tmp_path / "e.jsonl", seq_len=63).tokenized()
    schema = pa.schema([("messages", pa.string())])
    pq.write_table(schema.empty_table(), tmp_path / "e.parquet")
    with pytest.raises(ValueError, match="holds no conversations"):
        ChatMessages(TOKENIZER_DIR, tmp_path / "e.parquet", seq_len=63).tokenized()


def test_too_long_conversation_is_refused_or_counted_when_truncating(tmp_path):
    rows = [{"messages": QA}, {"messages": [QA[0], {"role": "assistant", "content": "dog " * 80}]}]
    path = _jsonl(tmp_path / "long.jsonl", rows)
    with pytest.raises(
        ValueError, match=r"row 1 of .* is \d+ tokens, longer than seq_len \+ 1 = 32"
    ):
        ChatMessages(TOKENIZER_DIR, path, seq_len=31).load(batch=2)
    spec = ChatMessages(TOKENIZER_DIR, path, seq_len=31, truncate=True)
    spec.load(batch=2)
    assert spec.stats["train"]["truncated"] == 1
    full = ChatMessages(TOKENIZER_DIR, path, seq_len=511).tokenized()[1]
    cut = spec.tokenized()[1]
    assert cut[0].tolist() == full[0][:32].tolist() and cut[1].tolist() == full[1][:32].tolist()


def test_bad_rows_files_and_settings(tmp_path):
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": QA}) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"line 2: not valid JSON"):
        ChatMessages(TOKENIZER_DIR, tmp_path / "bad.jsonl", seq_len=63).tokenized()
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"suffix '\.csv'; expected \.parquet"):
        ChatMessages(TOKENIZER_DIR, tmp_path / "x.csv", seq_len=63).tokenized()
    with pytest.raises(FileNotFoundError, match="no such JSONL file"):
        ChatMessages(TOKENIZER_DIR, tmp_path / "missing.jsonl", seq_len=63).tokenized()
    not_list = _jsonl(tmp_path / "s.jsonl", [{"messages": {"role": "user"}}])
    with pytest.raises(ValueError, match="expected a non-empty list of messages"):
        ChatMessages(TOKENIZER_DIR, not_list, seq_len=63).tokenized()
    with pytest.raises(ValueError, match="seq_len is 0; expected an int >= 1"):
        ChatMessages(TOKENIZER_DIR, not_list, seq_len=0)
    with pytest.raises(ValueError, match="batch is 0; expected an int >= 1"):
        ChatMessages(TOKENIZER_DIR, not_list, seq_len=8).load(batch=0)
    with pytest.raises(TypeError, match="batch is 2.0; expected an int"):
        ChatMessages(TOKENIZER_DIR, not_list, seq_len=8).load(batch=2.0)
    with pytest.raises(TypeError, match="tokenizer is int; expected a Hub name"):
        ChatMessages(3, not_list, seq_len=8)
    broken = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    broken.chat_template = "{{ raise_exception('no tools here') }}"
    with pytest.raises(ValueError, match=r"row 0 .*chat template failed .*no tools here"):
        ChatMessages(broken, _jsonl(tmp_path / "q.jsonl", [{"messages": QA}]), 63).tokenized()


def test_hub_id_without_datasets_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(ImportError, match=r"Hub dataset id, which needs the optional 'datasets'"):
        ChatMessages(TOKENIZER_DIR, "someone/chats", seq_len=63).tokenized()


def test_hub_id_reads_the_local_cache_offline(monkeypatch):
    """A stand-in ``datasets`` module records how the loader calls it."""
    import huggingface_hub.constants as hub_constants

    calls = []

    class FakeDataset:
        def __init__(self, table):
            self.table = table

        def with_format(self, kind):
            assert kind == "arrow"
            return self

        def __getitem__(self, item):
            assert item == slice(None)
            return self.table

    def load_dataset(path, split=None, **kwargs):
        offline = (fake.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE)
        calls.append((path, split, kwargs, offline))
        if path == "someone/missing":
            raise FileNotFoundError("Dataset someone/missing is not cached")
        table = pa.table({"messages": [QA]})
        if split is None:
            return {"train": FakeDataset(table), "test": FakeDataset(table)}
        return FakeDataset(table)

    fake = types.ModuleType("datasets")
    fake.config = types.SimpleNamespace(HF_HUB_OFFLINE=False)
    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    before = hub_constants.HF_HUB_OFFLINE
    data = ChatMessages(TOKENIZER_DIR, "someone/chats", 63, split="train", options={"name": "en"})
    ((ids, roles),) = data.tokenized()
    assert calls == [("someone/chats", "train", {"name": "en"}, (True, True))]
    assert before == hub_constants.HF_HUB_OFFLINE and fake.config.HF_HUB_OFFLINE is False
    assert (roles == Role.ASSISTANT).any()
    with pytest.raises(
        ValueError,
        match=r"split is None but Hub dataset 'someone/chats' has splits \['test', 'train'\]",
    ):
        ChatMessages(TOKENIZER_DIR, "someone/chats", 63).tokenized()
    with pytest.raises(ValueError, match="not readable from the local Hub cache"):
        ChatMessages(TOKENIZER_DIR, "someone/missing", 63, split="train").tokenized()
    with pytest.raises(ValueError, match=r"options\['split'\] is set"):
        ChatMessages(TOKENIZER_DIR, "someone/chats", 63, options={"split": "x"}).tokenized()


@pytest.mark.parametrize("module", ["chat", "conversations", "packing"])
def test_docstring_examples_run(module):
    import importlib

    result = doctest.testmod(importlib.import_module(f"dew_pipe.data.{module}"))
    assert result.attempted > 0 and result.failed == 0
