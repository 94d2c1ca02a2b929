"""N-gram decontamination of training rows against gate suite documents (pure Python)."""

from campaign_orchestrator.dataset.decontamination import SuiteDocs, build_index, find_contamination, tokens

LONG_DOC = (
    "Natalia sold clips to forty eight of her friends in April and then she sold half as many clips "
    "in May how many clips did Natalia sell altogether"
)


def test_tokens_are_lowercased_words_without_punctuation():
    assert tokens("Encode  KQQ =") == ["encode", "kqq"]
    assert tokens("What's 2+2?") == ["what", "s", "2", "2"]


def test_a_shared_13_gram_contaminates_and_a_12_gram_does_not():
    index = build_index([SuiteDocs("gsm", [("d0", LONG_DOC)])], n=13)
    words = LONG_DOC.split()
    rows = [
        {"prompt": "Q: " + " ".join(words[3:16]).upper() + "!", "completion": "72"},  # 13 words, other case
        {"prompt": " ".join(words[3:15]), "completion": "72"},  # 12 words only
        {"prompt": "unrelated", "completion": " ".join(words[10:23]) + " ..."},  # through the teacher's output
        {"prompt": "encode kqq =", "completion": "nvv"},
    ]
    found = find_contamination(rows, index)
    assert sorted(found.rows) == [0, 2]
    assert found.rows[0] == {("gsm", "d0")}
    assert found.by_field == {"prompt": 1, "completion": 1}


def test_short_documents_are_matched_whole_and_tiny_ones_are_counted_not_checked():
    suites = [
        SuiteDocs("cipher", [("0", "encode kqq ="), ("1", "encode abc ="), ("2", "=")]),
        SuiteDocs("harness/cipher_gen", [("7", "encode abc =")]),
    ]
    index = build_index(suites, n=13, min_doc_tokens=2)
    rows = [
        {"prompt": "encode kqq =", "completion": "nvv"},  # the whole short document
        {"prompt": "please encode abc = now", "completion": "x"},  # inside a longer prompt: both suites
        {"prompt": "encode kqqz =", "completion": "y"},  # another word
        {"prompt": "kqq encode", "completion": "z"},
    ]  # the tokens, not in order
    found = find_contamination(rows, index)
    assert sorted(found.rows) == [0, 1]
    assert found.rows[1] == {("cipher", "1"), ("harness/cipher_gen", "7")}
    s = found.summary(len(rows), ids=["a", "b", "c", "d"])
    assert s["contaminated_rows"] == 2 and s["training_rows"] == 4
    assert s["suites"]["cipher"] == {
        "documents_checked": 2,
        "documents_too_short": 1,
        "training_rows_overlapping": 2,
        "documents_overlapped": 2,
    }
    assert s["suites"]["harness/cipher_gen"]["training_rows_overlapping"] == 1
    assert [e["row"] for e in s["examples"]] == ["a", "b"]
