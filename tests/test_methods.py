"""Every method through the same checks, PEFT-style: one table of cases, shared assertions."""

import pytest
import torch

from aot.training.data.task import TaskSpec
from aot.training.factory import build_task_model
from aot.training.methods import METHODS, MethodError, make_config
from aot.training.methods.aot_ptuning.model import AotBody
from aot.training.methods.finetune import PlainBody
from tests.tiny import ARCHS, tiny_backbone

SPEC = TaskSpec("t", ("negative", "positive"), "accuracy")


def _encoder_trainable(name: str) -> bool:
    return name.startswith("body.") and not name.startswith(("body.aot.", "body.adapters."))


# method -> predicate every trainable parameter name outside the head must satisfy
TRAINABLE = {
    "fc": lambda n: n in {"body.aot.w1", "body.aot.b1", "body.aot.w2", "body.aot.b2"},
    "kron": lambda n: n in {"body.aot.w_left", "body.aot.w_mid", "body.aot.w_right"},
    "bitfit": lambda n: n.endswith(".bias"),
    "lora": lambda n: ".lora_A." in n or ".lora_B." in n,
    "prefix": lambda n: "prompt_encoder" in n,
    "prompt": lambda n: "prompt_encoder" in n,
    "adapter": lambda n: n.startswith("body.adapters.") or "LayerNorm" in n or "layer_norm" in n,
    "full": lambda n: n.startswith("body."),
}
# methods that start as the identity, so that an untrained model computes what the frozen backbone computes
IDENTITY_AT_INIT = ("fc", "kron", "lora", "adapter")
UNSUPPORTED = {("prefix", "deberta-v2")}

CASES = [(m, a) for m in METHODS for a in ARCHS if (m, a) not in UNSUPPORTED]


def _batch(backbone, pair=False):
    texts = ["good movie w1 w2", "the plot was dull", "w3"]
    enc = backbone.tokenizer(texts, ["w4 w5"] * 3 if pair else None, padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"], enc.get("token_type_ids")


def test_registry_covers_the_paper_methods():
    assert set(METHODS) == {"fc", "kron", "bitfit", "lora", "prefix", "prompt", "adapter", "full"}


@pytest.mark.parametrize("method,arch", CASES)
def test_trainable_parameters(method, arch):
    backbone = tiny_backbone(arch)
    model = build_task_model(backbone, make_config(method), SPEC)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    head = {"head.dense.weight", "head.dense.bias", "head.out.weight", "head.out.bias"}
    assert head <= names
    body = names - head
    assert body, "a method must train something besides the head"
    bad = sorted(n for n in body if not TRAINABLE[method](n))
    assert not bad, f"{method} trains unexpected parameters: {bad[:5]}"
    if method == "full":
        assert body == {n for n, _ in model.named_parameters() if n.startswith("body.")}
    if method == "bitfit":
        all_biases = {n for n, _ in model.body.named_parameters() if n.endswith(".bias")}
        assert body == {f"body.{n}" for n in all_biases}
    # the caller's backbone is never modified
    assert not any(p.requires_grad for p in backbone.encoder.parameters())


@pytest.mark.parametrize("method,arch", [(m, a) for m, a in CASES if m in IDENTITY_AT_INIT])
def test_untrained_model_equals_frozen_backbone(method, arch):
    backbone = tiny_backbone(arch)
    model = build_task_model(backbone, make_config(method), SPEC).eval()
    plain = PlainBody(backbone).eval()
    ids, mask, types = _batch(backbone, pair=True)
    with torch.no_grad():
        expected = plain(ids, mask, types)
        got = model.body(ids, mask, types)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", ["fc", "kron"])
def test_aot_rows_on_the_fly_equal_full_formula(method, arch):
    backbone = tiny_backbone(arch)
    model = build_task_model(backbone, make_config(method, rank=3), SPEC).eval()
    body: AotBody = model.body
    torch.manual_seed(1)
    with torch.no_grad():
        for p in body.aot.parameters():
            p.normal_()
    E = body.embeddings
    V = E.shape[0]
    with torch.no_grad():
        if method == "fc":
            a = body.aot
            full = torch.stack([torch.tanh(E @ a.w1[i] + a.b1[i]) @ a.w2[i] + a.b2[i] for i in range(a.w1.shape[0])])
        else:
            a = body.aot
            full = torch.stack([(torch.kron(a.w_left[i], a.w_mid[i]) @ a.w_right[i])[:V]
                                for i in range(a.w_left.shape[0])])
        ids = torch.tensor([0, 5, V - 1, 17, 5])
        rows = body.rows(ids)  # [U, L, d]
    torch.testing.assert_close(rows, full[:, ids].transpose(0, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", ["fc", "kron"])
def test_aot_bias_reaches_every_layer(method, arch):
    """A bias only in layer i changes the output: the hook is wired before every layer, not just the first."""
    backbone = tiny_backbone(arch)
    model = build_task_model(backbone, make_config(method), SPEC).eval()
    ids, mask, types = _batch(backbone)
    with torch.no_grad():
        base = model.body(ids, mask, types)
        last = model.body.aot.b2 if method == "fc" else None
        if method == "fc":
            last[-1].fill_(0.5)  # only the last layer's bias
        else:
            model.body.aot.w_right[-1].fill_(0.1)
        moved = model.body(ids, mask, types)
    assert (moved - base).abs().max() > 1e-3


def test_kron_factor_sizes():
    cfg = make_config("kron").resolve(30522)
    assert cfg.a * cfg.b >= 30522 and abs(cfg.a - cfg.b) <= 1
    cfg = make_config("kron", a=256).resolve(50265)
    assert (cfg.a, cfg.b) == (256, 197)
    with pytest.raises(MethodError, match="a \\* b"):
        make_config("kron", a=10, b=10).resolve(30522)


def test_prefix_on_deberta_is_refused_clearly():
    with pytest.raises(MethodError, match="deberta-v2"):
        build_task_model(tiny_backbone("deberta-v2"), make_config("prefix"), SPEC)


@pytest.mark.parametrize("bad", [dict(rank=0), dict(dropout=1.5), dict(activation="swishy")])
def test_bad_hyperparameters(bad):
    with pytest.raises(MethodError):
        make_config("fc", **bad)


def test_unknown_method():
    with pytest.raises(MethodError, match="unknown method 'nope'"):
        make_config("nope")


@pytest.mark.parametrize("embedding_std", [0.02, 0.056, 0.5])
def test_fc_first_projection_is_of_order_one(embedding_std):
    """W1's init adapts to the scale of E, so that f sees inputs of order one for fresh and pretrained models."""
    from aot.training.methods.aot_ptuning.layer import FCPrompt

    torch.manual_seed(0)
    E = torch.randn(2000, 64) * embedding_std
    prompt = FCPrompt(make_config("fc", rank=32), num_layers=2, hidden_size=64, embedding_std=float(E.std()))
    pre = torch.einsum("ud,ldr->lur", E, prompt.w1)
    assert 0.7 < float(pre.detach().std()) < 1.4


def test_unknown_config_keys_are_warned_about_and_skipped():
    import warnings

    cls = METHODS["fc"].config_cls
    with pytest.warns(UserWarning) as record:
        config = cls.from_json({"method": "fc", "rank": 8, "rnak": 16, "extra": True})
    assert config.rank == 8
    [warning] = record
    message = str(warning.message)
    assert message.startswith("method 'fc': ignoring unknown config keys extra, rnak (known: ")
    assert all(name in message.split("known: ")[1] for name in ("rank", "activation", "dropout"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "method" and every field of to_json() are expected: no warning
        assert cls.from_json(make_config("fc", rank=8).to_json()) == config
