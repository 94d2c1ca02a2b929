"""Teacher top-k log-probabilities through the dataset stage (logit distillation), on hand-built
examples: placement on the answer tokens (plain and chat templates), truncation, counted
misalignments, packing that keeps every list on its token, and the shards of a build."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401 - pa.compute
import pyarrow.parquet as pq
import pytest

from campaign_orchestrator.dataset.formatting import (
    IGNORE,
    EncodeSettings,
    encode_batch,
    encode_batch_arrow,
    resolve_template,
)
from campaign_orchestrator.dataset.packing import pack_bfd, pack_rows
from campaign_orchestrator.dataset.topk import TEACHER_IDS, TEACHER_LOGPROBS
from tests.support.dataprep_support import chars


def generation(tok, completion: str, stopped: bool = True, k: int = 3, salt: int = 0) -> dict:
    """A teacher generation as the distillation set carries it: the generated ids (stop token included
    when it stopped) and one top-k list per generated token, the generated token first. Log-probs
    encode (salt, position) so a list that lands on the wrong token is caught."""
    gen = chars(tok, completion) + ([tok.eos_token_id] if stopped else [])
    top = [
        [
            {"token_id": t if j == 0 else 100 + j, "token": None, "logprob": -(salt * 100 + pos + j / 10) / 1000}
            for j in range(k)
        ]
        for pos, t in enumerate(gen)
    ]
    return {"completion_token_ids": gen, "top_logprobs": top}


def run(tok, rows: list[dict], max_seq_len: int = 64, **kw) -> dict:
    batch = {k: [r.get(k) for r in rows] for k in {k for r in rows for k in r}}
    return encode_batch(batch, tok, resolve_template(tok), EncodeSettings(max_seq_len, **kw))


def check_lines_up(
    ids: list[int], labels: list[int], t_ids: list[list[int]], t_lps: list[list[float]], answer: list[int]
) -> None:
    """One list per token; lists exactly on the answer's label positions, each headed by its own token."""
    assert len(t_ids) == len(t_lps) == len(ids) == len(labels)
    placed = [i for i, lst in enumerate(t_ids) if lst]
    assert [ids[i] for i in placed] == answer
    for i in placed:
        assert labels[i] == ids[i] != IGNORE and t_ids[i][0] == ids[i] and len(t_lps[i]) == len(t_ids[i])


def test_plain_template_puts_each_list_on_its_completion_token_and_eos(tok):
    row = {"id": "a", "prompt": "encode abc =", "completion": " xyz"} | generation(tok, " xyz")
    out = run(tok, [row])
    ids, labels = out["input_ids"][0], out["labels"][0]
    eos = tok.eos_token_id
    assert ids == [tok.bos_token_id, *chars(tok, "encode abc ="), *chars(tok, " xyz"), eos]
    check_lines_up(ids, labels, out[TEACHER_IDS][0], out[TEACHER_LOGPROBS][0], chars(tok, " xyz") + [eos])
    first = ids.index(chars(tok, " ")[0], 1 + len("encode abc ="))
    assert out[TEACHER_LOGPROBS][0][first][0] == pytest.approx(-0.0)  # list 0 on the first completion token
    assert out["teacher_status"] == ["aligned"] and out["status"] == ["ok"]
    # stopped on max_new_tokens: no list for the appended EOS
    cut = run(tok, [{"id": "b", "prompt": "encode ab =", "completion": " qz"} | generation(tok, " qz", stopped=False)])
    check_lines_up(
        cut["input_ids"][0], cut["labels"][0], cut[TEACHER_IDS][0], cut[TEACHER_LOGPROBS][0], chars(tok, " qz")
    )


def test_chat_template_finds_the_completion_inside_the_assistant_turn(chat_tok):
    row = {"id": "a", "prompt": "encode ab =", "completion": " qz"} | generation(chat_tok, " qz")
    out = run(chat_tok, [row])
    ids, labels = out["input_ids"][0], out["labels"][0]
    # the turn is " qz</s> ": the teacher's EOS lands on the template's EOS; the trailing " " (the template's
    # separator after the end of turn) is not learnt at all: the loss ends on the EOS
    assert ids == chars(chat_tok, "user =encode ab = assistant =") + chars(chat_tok, " qz") + [
        chat_tok.eos_token_id
    ] + chars(chat_tok, " ")
    check_lines_up(
        ids, labels, out[TEACHER_IDS][0], out[TEACHER_LOGPROBS][0], chars(chat_tok, " qz") + [chat_tok.eos_token_id]
    )
    assert labels[-1] == IGNORE and labels[-2] == chat_tok.eos_token_id and out[TEACHER_IDS][0][-1] == []
    assert out["teacher_status"] == ["aligned"]


def test_rows_whose_tokens_are_not_the_teachers_keep_ce_but_get_no_lists(tok):
    other = generation(tok, " abc")  # the teacher generated something else than the stored completion
    no_ids = generation(tok, " qz")
    no_ids["top_logprobs"] = [[e | {"token_id": None, "token": "q"} for e in pos] for pos in no_ids["top_logprobs"]]
    short = generation(tok, " qz")
    short["top_logprobs"] = short["top_logprobs"][:1]
    rows = [
        {"id": "x", "prompt": "encode ab =", "completion": " qz"} | other,
        {"id": "y", "prompt": "encode ab =", "completion": " qz"} | no_ids,
        {"id": "z", "prompt": "encode ab =", "completion": " qz"} | short,
        {"id": "n", "prompt": "encode ab =", "completion": " qz", "top_logprobs": None},
    ]
    out = run(tok, rows)
    assert out["teacher_status"] == ["not_found", "no_token_ids", "count_mismatch", "none"]
    assert out["status"] == ["ok"] * 4 and all(n > 0 for n in out["num_loss_tokens"])
    for i in range(4):
        assert out[TEACHER_IDS][i] == [[]] * len(out["input_ids"][i]) == out[TEACHER_LOGPROBS][i]


def test_truncation_cuts_the_lists_with_the_row_and_drops_drop_them(tok):
    row = {"id": "a", "prompt": "encode abcdefgh =", "completion": " abcdefgh"} | generation(tok, " abcdefgh")
    full = run(tok, [row])
    n = len(full["input_ids"][0])
    cut = run(tok, [row], max_seq_len=n - 4, too_long="truncate")
    assert cut["status"] == ["truncated"] and len(cut["input_ids"][0]) == n - 4
    assert cut[TEACHER_IDS][0] == full[TEACHER_IDS][0][: n - 4]
    check_lines_up(
        cut["input_ids"][0],
        cut["labels"][0],
        cut[TEACHER_IDS][0],
        cut[TEACHER_LOGPROBS][0],
        chars(tok, " abcdefgh")[:-3],
    )
    dropped = run(tok, [row], max_seq_len=n - 1)
    assert dropped["status"] == ["too_long"] and dropped[TEACHER_IDS] == [[]]


def test_packed_rows_keep_every_teacher_list_on_its_token(tok):
    words = ["ab", "abcdefgh", "qqq", "xyzw", "k", "mnopq", "abcdefghijklmnopqrstuvwxyzabcd", "r"]
    rows = [
        {"id": f"r{i}", "prompt": f"encode {w} =", "completion": f" {w[::-1]}"}
        | generation(tok, f" {w[::-1]}", stopped=i % 3 != 0, salt=i)
        for i, w in enumerate(words)
    ]
    rows.append({"id": "plain", "prompt": "encode zz =", "completion": " zz", "top_logprobs": None})
    cols = ("id", "prompt", "completion", "completion_token_ids", "top_logprobs")
    batch = {k: [r.get(k) for r in rows] for k in cols}
    examples = encode_batch_arrow(batch, tok, resolve_template(tok), EncodeSettings(64))
    assert examples.schema.field(TEACHER_IDS).type == pa.list_(pa.list_(pa.int32()))
    assert examples.column("status").to_pylist()[6] == "too_long"  # dropped before packing, as the build does
    examples = examples.filter(pa.compute.equal(examples.column("status"), "ok"))
    per_example = {r["id"]: r for r in examples.to_pylist()}
    bins = pack_bfd(examples.column("num_tokens").to_numpy(), 64)
    assert any(len(b) > 2 for b in bins)
    packed = pack_rows(examples, bins)
    assert packed.num_rows == len(bins)
    seen = set()
    for row in packed.to_pylist():
        ids, labels, t_ids, t_lps = row["input_ids"], row["labels"], row[TEACHER_IDS], row[TEACHER_LOGPROBS]
        assert len(t_ids) == len(t_lps) == len(ids) == len(labels) == len(row["position_ids"])
        starts = [*np.flatnonzero(np.array(row["position_ids"]) == 0).tolist(), len(ids)]
        for j, ex in enumerate(row["example_ids"]):
            a, b = starts[j], starts[j + 1]
            want = per_example[ex]
            assert ids[a:b] == want["input_ids"] and labels[a:b] == want["labels"]
            assert t_ids[a:b] == want[TEACHER_IDS] and t_lps[a:b] == want[TEACHER_LOGPROBS]
            if ex == "plain":
                assert not any(t_ids[a:b])
                continue
            i = int(ex[1:])
            answer = chars(tok, f" {words[i][::-1]}") + ([tok.eos_token_id] if i % 3 else [])
            check_lines_up(ids[a:b], labels[a:b], t_ids[a:b], t_lps[a:b], answer)
            first = next(p for p in range(a, b) if t_lps[p])
            assert t_lps[first][0] == pytest.approx(-(i * 100) / 1000)  # this example's lists, not a neighbour's
            seen.add(ex)
    assert len(seen) == len(words) - 1


def test_build_writes_teacher_columns_in_both_splits_only_when_the_source_has_them(tmp_path, demo_models, tok):
    from campaign_orchestrator.dataset.tokenize import (
        ROW_SCHEMA,
        TEACHER_ROW_SCHEMA,
        BuildSettings,
        build_tokenized_dataset,
        dataset_metadata,
    )
    from campaign_orchestrator.demo import cipher
    from stages.distillation_set import distill_schema

    items = cipher.items(60, seed=3)
    rows = [
        {"id": f"e{i}", "prompt": it["prompt"], "completion": " " + it["reference"]}
        | generation(tok, " " + it["reference"], salt=i)
        for i, it in enumerate(items)
    ]
    rows[0]["completion"] = " mismatch"  # a completion that is not what the teacher generated
    src = tmp_path / "distillation.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=distill_schema()), src)
    settings = BuildSettings(max_seq_len=48, validation_fraction=0.25, split_seed=1)
    report = build_tokenized_dataset(demo_models["student"], [src], tmp_path / "out", settings)
    t = report["teacher_topk"]
    assert t["k"] == 3 and t["examples"]["aligned"] == 59 and t["examples"]["not_found"] == 1
    assert t["positions"] == sum(len(r["completion_token_ids"]) for r in rows[1:])
    for split in ("train", "validation"):
        files = sorted((tmp_path / "out" / split).glob("*.parquet"))
        assert pq.read_schema(files[0]).remove_metadata().equals(TEACHER_ROW_SCHEMA)
        assert '"k": 3' in dataset_metadata(files[0])["campaign.teacher_topk"]
        table = pq.read_table(files)
        for row in table.to_pylist():
            assert len(row[TEACHER_IDS]) == len(row["input_ids"])
            placed = [p for p, lst in enumerate(row[TEACHER_IDS]) if lst]
            assert all(row[TEACHER_IDS][p][0] == row["input_ids"][p] == row["labels"][p] for p in placed)
    # the same distillation set without logprobs (null columns): the classic schema, no teacher metadata
    plain = tmp_path / "plain.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [r | {"completion_token_ids": None, "top_logprobs": None} for r in rows], schema=distill_schema()
        ),
        plain,
    )
    r2 = build_tokenized_dataset(demo_models["student"], [plain], tmp_path / "plain", settings)
    assert r2["teacher_topk"] is None
    f = sorted((tmp_path / "plain" / "train").glob("*.parquet"))[0]
    assert pq.read_schema(f).remove_metadata().equals(ROW_SCHEMA) and "campaign.teacher_topk" not in dataset_metadata(f)
    assert (
        pq.read_table(f)
        .column("input_ids")
        .equals(pq.read_table(sorted((tmp_path / "out" / "train").glob("*.parquet"))[0]).column("input_ids"))
    )


def test_asset_key_and_the_logits_guard():
    """A campaign that stores top-k gets its own dataset key (the demo's is unchanged); loss `logits` on a
    dataset whose rows carry no teacher distribution fails, naming why."""
    import yaml

    from campaign_orchestrator.dataset.tokenize import BuildSettings
    from campaigns.spec import CampaignSpec
    from stages import tokenized_dataset as tokenized
    from stages.common import stage_key

    s = BuildSettings(max_seq_len=64)
    assert tokenized.content_key("d", "t", s, None) == stage_key(
        tokenized.STAGE_VERSION, "d", "t", s.key_fields(), None
    )
    assert tokenized.content_key("d", "t", s, None, teacher_topk=True) != tokenized.content_key("d", "t", s, None)
    raw = yaml.safe_load(open("campaigns/demo.yaml").read())
    tokenized.check_teacher_topk(CampaignSpec.model_validate(raw), {"teacher_topk": None})  # loss `sequence`
    raw["teacher"]["sampling"]["logprobs"] = 4
    raw["training"]["distillation"] = {"loss": "logits"}
    spec = CampaignSpec.model_validate(raw)
    tokenized.check_teacher_topk(spec, {"teacher_topk": {"k": 4, "positions": 10, "examples": {"aligned": 2}}})
    with pytest.raises(ValueError, match=r"no token .* teacher top-k.*no_token_ids': 5"):
        tokenized.check_teacher_topk(
            spec, {"teacher_topk": {"k": 0, "positions": 0, "examples": {"aligned": 0, "no_token_ids": 5}}}
        )
    with pytest.raises(ValueError, match="no top_logprobs in the distillation set"):
        tokenized.check_teacher_topk(spec, {"teacher_topk": None})
