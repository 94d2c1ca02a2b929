"""Loss masks, templates, EOS and bad rows of campaign_orchestrator.dataset.formatting, on hand-built examples."""

from __future__ import annotations

import pytest

from campaign_orchestrator.dataset.formatting import (
    IGNORE,
    EncodeSettings,
    FormatError,
    Template,
    check_prefix_space,
    encode_batch,
    prompt_token_ids,
    resolve_template,
)
from tests.support.dataprep_support import CHAT, chars


def run(tok, rows: list[dict], max_seq_len: int = 64, template: Template | None = None, **kw) -> dict:
    template = template or resolve_template(tok)
    batch = {k: [r.get(k) for r in rows] for k in {k for r in rows for k in r}}
    return encode_batch(batch, tok, template, EncodeSettings(max_seq_len, **kw))


def test_plain_template_masks_exactly_the_completion_and_eos(tok):
    out = run(tok, [{"id": "a", "prompt": "encode abc =", "completion": " xyz"}])
    p, c = chars(tok, "encode abc ="), chars(tok, " xyz")
    bos, eos = tok.bos_token_id, tok.eos_token_id
    assert out["input_ids"][0] == [bos, *p, *c, eos]
    assert out["labels"][0] == [IGNORE] * (1 + len(p)) + c + [eos]
    assert out["num_loss_tokens"][0] == len(c) + 1  # every completion token once, plus EOS, no prompt token
    assert out["status"] == ["ok"]


def test_train_on_prompt_labels_everything_but_the_first_token(tok):
    out = run(tok, [{"id": "a", "prompt": "encode ab =", "completion": " q"}], train_on_prompt=True)
    ids = out["input_ids"][0]
    assert out["labels"][0] == [IGNORE, *ids[1:]]


def test_eos_is_not_doubled_and_first_token_never_has_a_label(tok):
    # a completion that already ends with EOS keeps one EOS; an empty prompt without BOS still masks token 0
    no_bos = Template("plain", None, tok.eos_token_id)
    out = run(tok, [{"id": "a", "prompt": "", "completion": " ab</s>"}], template=no_bos)
    assert out["input_ids"][0] == [*chars(tok, " ab"), tok.eos_token_id]
    assert out["labels"][0][0] == IGNORE and out["labels"][0][1:] == out["input_ids"][0][1:]


def test_chat_template_masks_assistant_turns_only(chat_tok):
    msgs = [
        {"role": "user", "content": "encode ab ="},
        {"role": "assistant", "content": " qz"},
        {"role": "user", "content": "encode c ="},
        {"role": "assistant", "content": " w"},
    ]
    out = run(chat_tok, [{"id": "m", "messages": msgs}], max_seq_len=128)
    text = lambda s: chars(chat_tok, s)  # noqa: E731
    eos = chat_tok.eos_token_id
    # each assistant span runs from the generation prompt to the next turn: content, the template's EOS, " ";
    # the loss covers the content and the EOS (the model learns to stop), not the separator after it
    p1, p3 = text("user =encode ab = assistant ="), text("user =encode c = assistant =")
    a2, a4 = text(" qz") + [eos], text(" w") + [eos]
    sep = text(" ")
    assert out["input_ids"][0] == p1 + a2 + sep + p3 + a4 + sep
    assert out["labels"][0] == (
        [IGNORE] * len(p1) + a2 + [IGNORE] * (len(sep) + len(p3)) + a4 + [IGNORE] * len(sep)
    )  # EOS counted once, not appended
    # a pair goes through the same template as [user, assistant]
    pair = run(chat_tok, [{"id": "p", "prompt": "encode ab =", "completion": " qz"}])
    assert pair["input_ids"][0] == p1 + a2 + sep and pair["labels"][0] == [IGNORE] * len(p1) + a2 + [IGNORE] * len(sep)


def test_template_modes(tok, chat_tok):
    assert resolve_template(tok).kind == "plain"
    assert resolve_template(chat_tok).kind == "chat"
    assert resolve_template(chat_tok, "plain").kind == "plain"
    with pytest.raises(FormatError, match="no chat_template"):
        resolve_template(tok, "chat")


def test_too_long_is_dropped_or_truncated_and_counted(tok):
    row = {"id": "a", "prompt": "encode abcdefgh =", "completion": " abcdefgh"}
    n = len(run(tok, [row])["input_ids"][0])
    assert run(tok, [row], max_seq_len=n - 1)["status"] == ["too_long"]
    cut = run(tok, [row], max_seq_len=n - 3, too_long="truncate")
    assert cut["status"] == ["truncated"] and len(cut["input_ids"][0]) == n - 3
    # truncation that leaves no completion token is a drop, not an example with nothing to learn
    assert run(tok, [row], max_seq_len=5, too_long="truncate")["status"] == ["no_loss_tokens"]


def test_bad_rows_are_counted_not_kept(tok):
    rows = [
        {"id": "ok", "prompt": "encode a =", "completion": " q"},
        {"id": "none", "prompt": None, "completion": " q"},
        {"id": "int", "prompt": 5, "completion": " q"},
    ]
    out = run(tok, rows)
    assert out["status"] == ["ok", "missing_field", "not_a_string"]
    assert out["input_ids"][1:] == [[], []]
    bad_msgs = [
        {"id": "m1", "messages": [{"role": "user", "content": "hi"}]},  # no assistant turn
        {"id": "m2", "messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {"id": "m3", "messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]},
        {"id": "m4", "messages": "not a list"},
        {
            "id": "m5",
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"},
                {"role": "assistant", "content": "d"},
            ],
        },
    ]
    out = run(tok, bad_msgs)  # plain template: multi-turn cannot be expressed
    assert out["status"] == [
        "invalid_messages",
        "invalid_messages",
        "not_a_string",
        "invalid_messages",
        "invalid_messages",
    ]


def test_prompt_token_ids_match_the_training_prefix(tok, chat_tok):
    """What evaluation should feed the model: exactly the tokens that precede the completion in training."""
    for t in (tok, chat_tok):
        out = run(t, [{"id": "a", "prompt": "encode ab =", "completion": " qz"}])
        ids, labels = out["input_ids"][0], out["labels"][0]
        first_loss = next(i for i, x in enumerate(labels) if x != IGNORE)
        assert prompt_token_ids(t, "encode ab =") == ids[:first_loss]
    assert prompt_token_ids(tok, "encode ab =") == tok("encode ab =")["input_ids"]  # what generation does today


def test_arrow_pair_path_equals_the_general_path(tok):
    """Pairs are assembled with numpy in the map function; the result is the general path's, row by row,
    for every setting and for rows that are dropped."""
    import pyarrow as pa

    from campaign_orchestrator.dataset.formatting import encode_batch_arrow

    rows = [
        {"id": f"r{i}", "prompt": f"encode {w} =", "completion": f" {w[::-1]}"}
        for i, w in enumerate(["ab", "abcdefgh", "qqq", "z" * 40, "k" * 25, "abcdefghij"])
    ]
    rows += [
        {"id": "eos", "prompt": "", "completion": " ab</s>"},
        {"id": "none", "prompt": None, "completion": "x"},
        {"id": "int", "prompt": "a", "completion": 3},
    ]
    batch = {k: [r[k] for r in rows] for k in ("id", "prompt", "completion")}
    for template in (resolve_template(tok), Template("plain", None, tok.eos_token_id)):
        for kw in (
            {},
            {"train_on_prompt": True},
            {"too_long": "truncate"},
            {"too_long": "truncate", "train_on_prompt": True},
        ):
            settings = EncodeSettings(30, **kw)
            want = encode_batch(batch, tok, template, settings)
            got = encode_batch_arrow(batch, tok, template, settings)
            assert isinstance(got, pa.Table) and got.to_pydict() == want, (template, kw)
            if kw.get("too_long") == "truncate":
                assert "truncated" in want["status"]
                assert ("no_loss_tokens" in want["status"]) != bool(kw.get("train_on_prompt"))
    # an Arrow batch (what map passes for an Arrow-formatted dataset of string columns) gives the same table
    strings = pa.Table.from_pylist([r for r in rows if isinstance(r["completion"], str)])
    as_lists = {k: strings.column(k).to_pylist() for k in strings.column_names}
    for kw in ({}, {"too_long": "truncate"}):
        settings = EncodeSettings(30, **kw)
        assert encode_batch_arrow(strings, tok, resolve_template(tok), settings).equals(
            encode_batch_arrow(as_lists, tok, resolve_template(tok), settings)
        )
    # and the general path for pairs is the same as for a one-exchange conversation
    msgs = {
        "id": batch["id"][:6],
        "messages": [
            [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}]
            for r in rows[:6]
        ],
    }
    pairs5 = {k: v[:6] for k, v in batch.items()}
    assert encode_batch(msgs, tok, resolve_template(tok), EncodeSettings(30)) == encode_batch(
        pairs5, tok, resolve_template(tok), EncodeSettings(30)
    )


def test_prefix_space_is_checked_against_a_template_that_trims_the_turn(tok, chat_tok):
    check_prefix_space(tok, resolve_template(tok, "plain"))  # prompt and completion are concatenated as written
    check_prefix_space(chat_tok, resolve_template(chat_tok))  # the content as written: " x" stays " x"
    chat_tok.chat_template = CHAT.replace("m['content']", "m['content'] | trim")
    with pytest.raises(FormatError, match="prefix_space: true, but the student's chat template strips the space"):
        check_prefix_space(chat_tok, resolve_template(chat_tok))
