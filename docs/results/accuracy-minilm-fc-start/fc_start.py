"""Issue 13, 'the start of FC': three variants of FC against the defaults, same budget and seeds as the recipe runs
(MiniLM, Rotten Tomatoes, 1,600 training examples, 64 tokens, exactly 100 steps, dev every 10, seeds 0-2).

  head_lr   the head at 5e-3, the factors at the default 1e-3 (a learning rate per parameter group)
  offset    W2 drawn at random (std 0.02) instead of 0, and P = FC(x) - FC_init(x) with the initial FC frozen:
            P = 0 at step 0 (the paper's property), but W1 gets gradient from the first step. Foldable into a
            plain FC of rank 2r at save time ([W1, W1_0], [b1, b1_0], [W2; -W2_0]).
  scale     P^i multiplied by s_i = rms(h^i) / mean_j rms(h^j), the RMS of the hidden states entering layer i on
            64 training texts: layers whose states are large get a proportionally larger bias step under Adam.
            Foldable into W2 and b2.
  base      the defaults (seed 0 only, to check that this script reproduces the recipe run).
One JSON line per run to the file named by argv[2]."""
import json, sys, tempfile, time

import torch

import training.methods.aot_ptuning.model as aot_model
from training.api import train_task
from training.backbone import load_backbone
from training.data import load_task_data
from training.methods.aot_ptuning.layer import FCPrompt, fc_rows

torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)


class OffsetFC(FCPrompt):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        with torch.no_grad():
            self.w2.normal_(0.0, 0.02)
        for name in ("w1", "b1", "w2", "b2"):
            self.register_buffer(name + "_0", getattr(self, name).detach().clone())

    def rows(self, token_ids, embeddings):
        e = self.dropout(embeddings[token_ids].to(self.w1.dtype))
        return (fc_rows(e, self.w1, self.b1, self.w2, self.b2, self.act)
                - fc_rows(e, self.w1_0, self.b1_0, self.w2_0, self.b2_0, self.act))


SCALE = None


class ScaledFC(FCPrompt):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.register_buffer("scale", SCALE.clone())

    def rows(self, token_ids, embeddings):
        return super().rows(token_ids, embeddings) * self.scale[None, :, None]


def layer_scales(backbone, data):
    texts = [ex.text for ex in data.train[:64]]
    enc = backbone.tokenizer(texts, padding=True, truncation=True, max_length=64, return_tensors="pt")
    with torch.no_grad():
        out = backbone.encoder(**enc, output_hidden_states=True)
    mask = enc["attention_mask"].bool()
    rms = torch.stack([h[mask].pow(2).mean().sqrt() for h in out.hidden_states[:-1]])
    return rms / rms.mean()


def main():
    variant, out_path = sys.argv[1], sys.argv[2]
    seeds = [0] if variant == "base" else [0, 1, 2]
    backbone = load_backbone("minilm")
    data = load_task_data("rotten_tomatoes")
    kw = {}
    if variant == "offset":
        aot_model.FCPrompt = OffsetFC
    elif variant == "scale":
        global SCALE
        SCALE = layer_scales(backbone, data)
        print("scales", [round(float(s), 3) for s in SCALE], flush=True)
        aot_model.FCPrompt = ScaledFC
    elif variant == "head_lr":
        kw["head_lr"] = 5e-3
    for seed in seeds:
        t = time.time()
        with tempfile.TemporaryDirectory() as d:
            r = train_task(model="minilm", data="rotten_tomatoes", method="fc", out=d + "/t", backbone=backbone,
                           task_data=data, seed=seed, max_train_samples=1600, max_length=64, epochs=10 ** 6,
                           patience=10 ** 9, max_steps=100, eval_every=10, progress=False, **kw)
            hist = json.load(open(d + "/t/metrics.json"))["history"]
        rec = {"variant": variant, "seed": seed, "dev": r["dev"], "test": r["test"], "best_step": r["best_step"],
               "curve": [round(h["dev"], 4) for h in hist], "secs": round(time.time() - t, 1)}
        if variant == "scale":
            rec["scales"] = [round(float(s), 4) for s in SCALE]
        print(json.dumps(rec), flush=True)
        with open(out_path, "a") as f:
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
