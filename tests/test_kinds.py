"""Tasks of every kind in PyTorch: the readers of tags, labels and pairs (their errors name file and line), the
alignment of tags to word pieces, the entity rule against seqeval, training each kind, `aot predict` / `aot
evaluate` per kind, and the PEFT-shaped API on a token classifier and an embedding under transformers.Trainer.
Serving them: tests/test_kinds_served.py."""

import json
import random

import numpy as np
import pytest
import torch

from aot.cli.main import main
from aot.serving.tokenization import Tokenization
from aot.serving.words import entity_spans, split_words
from aot.training.artifact import read_task
from aot.training.data import DataError, load_task_data
from aot.training.kinds.tokens import IGNORED, TokensKind, align
from aot.training.predict import Predictor, predict_lines, task_folders


@pytest.mark.parametrize("content, error", [
    ("good\tB-pos\nw1\tO\n\nbad\tB-x\nw2\tQ-x\n", r"train.conll:5: tag 'Q-x' is not a BIO tag"),
    ("good\tB-pos\nw1\n", r"train.conll:2: expected a word and its tag"),
    ("good\tB-pos\nw 1\tO\n", r"train.conll:2: token 'w 1' is empty or holds whitespace"),
])
def test_conll_errors_name_file_and_line(tmp_path, content, error):
    (tmp_path / "train.conll").write_text(content)
    (tmp_path / "dev.conll").write_text("good\tB-pos\n")
    with pytest.raises(DataError, match=error):
        load_task_data(str(tmp_path), problem="tokens")


@pytest.mark.parametrize("line, error", [
    ({"tokens": ["a", "b"], "tags": ["O"]}, r"dev.jsonl:2: 2 tokens but 1 tags"),
    ({"tokens": ["a"], "tags": "O"}, r"dev.jsonl:2: 'tags' must be a non-empty list of strings"),
    ({"tokens": ["a"], "tags": ["B-neg"]}, r"dev.jsonl:2: dev tag 'B-neg' never occurs in train"),
])
def test_token_lines_errors_name_file_and_line(tmp_path, line, error):
    (tmp_path / "train.jsonl").write_text(json.dumps({"tokens": ["good", "w1"], "tags": ["B-pos", "O"]}) + "\n")
    (tmp_path / "dev.jsonl").write_text(json.dumps({"tokens": ["w1"], "tags": ["O"]}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(DataError, match=error):
        load_task_data(str(tmp_path), problem="tokens")


def test_conll_reads_lone_tab_separators_and_columns(tmp_path):
    """WNUT-16's file separates tweets with a lone tab; CoNLL-2003 has four space-separated columns, the tag last."""
    (tmp_path / "train.txt").write_text("-DOCSTART- -X- O O\n\nEU NNP B-NP B-org\nrejects VBZ B-VP O\n\t\nGerman JJ B-NP B-misc\n")
    (tmp_path / "dev.conll").write_text("Paris\tB-misc\n\t\n")
    data = load_task_data(str(tmp_path), problem="tokens")
    assert [(ex.text, ex.label) for ex in data.train] == [("EU rejects", ("B-org", "O")), ("German", ("B-misc",))]
    assert data.spec.kind == "tokens" and data.spec.metric == "entity_f1"
    assert data.spec.labels == ("O", "B-misc", "B-org")  # O first, then by type


def test_multilabel_and_pair_rows(tmp_path):
    """Multi-label CSV (labels separated by `|`, an empty cell: none) and JSONL; pairs scored all or none."""
    ml = tmp_path / "ml"
    ml.mkdir()
    (ml / "train.csv").write_text("text,labels\ngood w1,pos\nbad good,neg|pos\nw2 w3,\n")
    (ml / "dev.jsonl").write_text(json.dumps({"text": "w4", "labels": []}) + "\n")
    data = load_task_data(str(ml), problem="multilabel")
    assert [ex.label for ex in data.train] == [("pos",), ("neg", "pos"), ()] and data.dev[0].label == ()
    assert data.spec.labels == ("neg", "pos") and data.spec.metric == "micro_f1"
    pairs = tmp_path / "pairs"
    pairs.mkdir()
    (pairs / "train.jsonl").write_text(json.dumps({"text": "a", "text_pair": "b", "score": 0.5}) + "\n"
                                       + json.dumps({"text": "c", "text_pair": "d"}) + "\n")
    (pairs / "dev.jsonl").write_text(json.dumps({"text": "a", "text_pair": "b"}) + "\n")
    with pytest.raises(DataError, match=r"train.jsonl:2: some pairs have a score and some do not"):
        load_task_data(str(pairs), problem="embedding")
    (pairs / "train.jsonl").write_text(json.dumps({"text": "c", "text_pair": "d"}) + "\n")
    data = load_task_data(str(pairs), problem="embedding")
    assert data.spec.metric == "recall@1" and data.spec.labels is None and not data.spec.has_pair


def test_tags_align_to_first_pieces_as_served(tmp_path):
    """A word of several pieces carries its tag on its first piece; the others, and special tokens, are ignored by
    the loss. The served tokenizer finds the same pieces and words (the real MiniLM WordPiece tokenizer)."""
    from transformers import AutoTokenizer

    from aot import model_path

    tokenizer = AutoTokenizer.from_pretrained(model_path("minilm"))
    tokenizer.save_pretrained(tmp_path)
    words, tags = ["Unbelievably", "naïve", "Zoë", "😀", "emojis!"], ["B-x", "O", "B-per", "O", "B-x"]
    text = "  Unbelievably naïve\tZoë 😀  emojis!"  # any whitespace between words
    from aot.training.data.task import Example, TaskSpec

    spec = TaskSpec("t", ("O", "B-per", "B-x"), "entity_f1", kind="tokens")
    encoded = TokensKind().encode(tokenizer, [Example(text, tuple(tags))], spec, 64)
    pieces = tokenizer.convert_ids_to_tokens(encoded.input_ids[0])
    starts = {pieces[k]: w for k, w in enumerate(encoded.first[0]) if w >= 0}
    assert starts == {"un": 0, "naive": 1, "zoe": 2, "[UNK]": 3, "em": 4}
    assert [pieces[k] for k, label in enumerate(encoded.labels[0]) if label == IGNORED] == [
        "[CLS]", "##bel", "##ie", "##va", "##bly", "##oj", "##is", "!", "[SEP]"]
    assert [spec.labels[label] for label in encoded.labels[0] if label != IGNORED] == tags
    served, words_found, first = Tokenization(tmp_path, True).encode_words([text], 64)
    assert served["input_ids"].tolist() == np.asarray(encoded.input_ids).tolist()
    assert first.tolist() == np.asarray(encoded.first).tolist()
    assert [text[s:e] for s, e in words_found[0].spans] == words
    ids, _, _, first = align(tokenizer, text, 8)  # truncated: the words past the max length have no piece
    assert len(ids) == 8 and set(first.tolist()) == {-1, 0, 1}


def test_entity_rule_is_seqeval():
    from seqeval.metrics.sequence_labeling import get_entities

    rng = random.Random(0)
    for _ in range(3000):
        tags = [rng.choice(["O", "B-a", "I-a", "B-b", "I-b"]) for _ in range(rng.randint(0, 9))]
        assert entity_spans(tags) == [tuple(e) for e in get_entities(tags)], tags
    words = split_words("😀 café  Zoë-Ann!")
    assert [words.text[s:e] for s, e in words.spans] == ["😀", "café", "Zoë-Ann!"] and words.spans[2] == (8, 16)


def test_each_kind_trains_saves_and_predicts(kind_artifacts, tmp_path, capsys):
    """Artifacts of the new kinds are aot-task v3 (a v2 reader refuses them), a classifier's stays v2; the dev score
    is the kind's metric (a multi-label task's at its threshold, tuned and recorded); `aot predict` mixes kinds in
    one MultiTaskModel batch and answers each as a single task would; `aot evaluate` scores a file of each kind."""
    metrics = {}
    for name, path in kind_artifacts.items():
        artifact = read_task(path)
        metrics[name] = artifact.metrics()
        assert artifact.config["format_version"] == (2 if name in ("cls", "score") else 3)
        assert metrics[name]["kind"] == artifact.kind and metrics[name]["dev"] > 0
    assert read_task(kind_artifacts["ner"]).metrics()["dev"] > 0.9  # the entities are learnable
    tags = read_task(kind_artifacts["tags"])
    assert tags.spec.threshold == metrics["tags"]["threshold"] and 0 < tags.spec.threshold < 1
    texts = ["good w1 bad movie", "w3 superb! w4", "w5 w6"]
    lines = [(k + 1, {"text": t, "text_pair": None, "task": name})
             for k, (t, name) in enumerate((t, n) for n in kind_artifacts for t in texts)]
    mixed = predict_lines(task_folders([f"{n}={p}" for n, p in kind_artifacts.items()]), lines, None)
    for k, (_, item) in enumerate(lines):
        single = Predictor.load(kind_artifacts[item["task"]]).predict([item["text"]], name=item["task"])[0]
        assert mixed[k + 1].keys() == single.keys()
        if item["task"] == "ner":
            assert [e | {"score": 0} for e in mixed[k + 1]["entities"]] == [e | {"score": 0} for e in single["entities"]]
        if item["task"] == "search":  # MultiTaskModel adds P as the store keeps it, fp16
            np.testing.assert_allclose(mixed[k + 1]["embedding"], single["embedding"], atol=2e-3)
    first_ner = next(n for n, item in lines if item["task"] == "ner")
    assert {e["text"]: e["label"] for e in mixed[first_ner]["entities"]} == {"good": "pos", "bad movie": "neg"}
    for name, kind in (("ner", "tokens"), ("tags", "multilabel"), ("search", "embedding")):
        dev = tmp_path / f"{name}.jsonl"
        source = read_task(kind_artifacts[name]).config["training"]["data"]
        dev.write_text(open(f"{source}/dev.jsonl").read())
        assert main(["evaluate", "--task", str(kind_artifacts[name]), str(dev)]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["score"] == pytest.approx(metrics[name]["dev"], abs=1e-6), name


def test_token_classifier_and_embedding_in_the_peft_api(tiny_models, tmp_path):
    """get_aot_model on an AutoModelForTokenClassification keeps its head exactly (untrained: its own logits); an
    embedding task on a bare AutoModel trains under transformers.Trainer on pairs (in-batch negatives) and saves an
    artifact whose answers are its vectors."""
    from transformers import AutoModel, AutoModelForTokenClassification, Trainer, TrainingArguments

    from aot import AotConfig, get_aot_model
    from aot.training.pair_collator import PairCollator

    folder = str(tiny_models["bert"])
    tagger = AutoModelForTokenClassification.from_pretrained(folder, num_labels=3).eval()
    model = get_aot_model(tagger, AotConfig(labels=["O", "B-x", "I-x"], max_length=32)).eval()
    ids = torch.tensor([[2, 7, 9, 12, 3]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, tagger(input_ids=ids).logits)
    assert model.spec.kind == "tokens" and model(ids, labels=torch.tensor([[-100, 0, 1, 2, -100]])).loss > 0
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(folder)
    encoder = AutoModel.from_pretrained(folder)
    model = get_aot_model(encoder, AotConfig(problem="embedding", max_length=32, rank=8))
    from tests.tiny import pair_examples

    rows = [{**tokenizer(r["text"]), **{f"pair_{k}": v for k, v in tokenizer(r["text_pair"]).items()}}
            for r in pair_examples(64, 1)]
    args = TrainingArguments(str(tmp_path / "run"), max_steps=8, per_device_train_batch_size=16, learning_rate=3e-3,
                             save_strategy="no", report_to=[])
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    Trainer(model=model, args=args, train_dataset=rows, data_collator=PairCollator(tokenizer)).train()
    assert any(not torch.equal(a, p) for a, p in zip(before, [p for p in model.parameters() if p.requires_grad], strict=True))
    model.save_pretrained(tmp_path / "task")
    answer = Predictor.load(tmp_path / "task").predict(["w1 w2"])[0]
    with torch.no_grad():
        vector = model.eval()(**tokenizer(["w1 w2"], return_tensors="pt")).embeddings[0]
    np.testing.assert_allclose(answer["embedding"], vector.numpy(), atol=1e-5)
    assert abs(np.linalg.norm(answer["embedding"]) - 1) < 1e-5


def test_a_task_reads_its_recorded_data_as_its_own_kind(kind_artifacts):
    """The data a task records it was trained on is read back as its kind (the int8 gate and re-fitting score its dev
    split through this), whatever the kind: a tagger's data as tokens, not as a classifier's."""
    from aot.training.artifact import read_task
    from aot.training.data import recorded_task_data

    for name in kind_artifacts:
        artifact = read_task(kind_artifacts[name])
        data = recorded_task_data(artifact.config["training"]["data"], artifact.spec)
        assert data.spec.kind == artifact.spec.kind and data.dev, name


def test_every_registered_kind_has_its_parts():
    """The registry of kinds (aot.serving.kinds) and what attaches to it by name: each registered kind has its
    training kind and a tiny task in the end-to-end table (tests.tiny.KIND_TASKS), metrics that exist, a head that
    reads what its answer needs; a record without a kind is read as before kinds; an unknown kind, a bad head and a
    training kind without a spec are refused, naming them."""
    from aot.serving.kinds import KINDS, NONE, KindSpec, kind_of, kind_spec
    from aot.training.kinds import KIND_OF, Kind, attach
    from aot.training.metrics import METRICS
    from tests.tiny import KIND_ROWS, KIND_TASKS

    assert len(KINDS) == 5 and set(KIND_OF) == set(KINDS) == set(KIND_TASKS.values()) == set(KIND_ROWS)
    for name, spec in KINDS.items():
        assert KIND_OF[name].name == name and spec.metrics and set(spec.metrics) <= set(METRICS), name
        assert (spec.answer is None) == spec.reads_tokens, name  # a token task answers from its words
        assert spec.unlabelled_outputs == (0 if spec.head == NONE else 1), name
    assert [kind_of({"labels": None}), kind_of({"labels": ["a", "b"]})] == ["regression", "classification"]
    with pytest.raises(ValueError, match="unknown kind 'ranking': expected one of classification, regression"):
        kind_spec("ranking")
    with pytest.raises(ValueError, match="kind 'ranking': head 'mlp'"):
        KindSpec("ranking", "{}", "rank", "mlp", labelled=False, metrics=("spearman",), answer=None,
                 label=lambda task, values: values)

    class Ranking(Kind):
        name = "ranking"

    with pytest.raises(ValueError, match="training kind 'ranking' has no spec"):
        attach(Ranking())
