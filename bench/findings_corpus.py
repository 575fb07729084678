"""The labelled corpus that scores the findings rules (bench/bench_findings.py, tests/test_findings_corpus.py).

Healthy runs really train (their loss falls): eight families (MLP, CNN with BatchNorm, LSTM, a
hand-written transformer, and Hugging Face BERT, GPT-2, ViT and Llama from tiny configs), three
optimizers, warmup + cosine schedules, gradient clipping, nets that leave an initial plateau, ReLU
nets with a few units dead from the start. Pathological runs get one pathology injected at a known
step and layer (`Case.inject`), and name the rules that must find it there (`Case.rules`,
`Case.layers`, `Case.at`). Every run logs its loss and learning rate, so lead times are measured
against the loss. Small on purpose: the whole corpus trains in a few minutes on two cores.
"""
from __future__ import annotations

import hashlib
import math
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

STEPS, PROBE_EVERY, BATCH = 200, 20, 32
VERSION = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]  # a trace of another corpus is trained again
VOCAB, SEQ, CLASSES = 24, 16, 4
LANGUAGE_MODELS = ("gpt2", "llama", "gemma2")


@dataclass(frozen=True)
class Case:
    """One run of the corpus. A pathological case names what must find it: one of `rules`, at a
    layer matching one of `layers` (glob patterns), at step `at` (± one probe reading); `window`
    instead accepts any step from `at` until the loss diverges, ± one reading (an explosion has no
    one step)."""

    name: str
    family: str
    optimizer: str = "adam"
    lr: float = 1e-3
    schedule: str = "constant"       # or "warmup-cosine", "restarts" (cosine, warm restarts), "one-cycle"
    recipe: str = ""                 # "smooth" (label smoothing), "mixup", "bad-batch" (one corrupted batch at K),
    #                                  "curriculum" (the data shifts at K), "grad-bug" (gradients ×1000 from K)
    clip: float | None = None
    seed: int = 0
    model: dict = field(default_factory=dict)   # the family's builder options
    inject: tuple = ()                          # (what, step, options): see `_inject`
    rules: tuple[str, ...] = ()
    layers: tuple[str, ...] = ("*",)
    at: int | None = None
    window: bool = False

    @property
    def healthy(self) -> bool:
        return not self.rules


def _healthy() -> list[Case]:
    cases = []
    for act in ("relu", "gelu", "tanh", "sigmoid"):
        depth, scale = (2, 4) if act == "sigmoid" else (3, 1)  # a sigmoid net's gradients are 4x smaller
        for opt, lr, sched in (("adam", 1e-3, "constant"), ("sgdm", 0.05, "constant"), ("adamw", 3e-3, "warmup-cosine")):
            cases.append(Case(f"mlp-{act}-{opt}", "mlp", opt, lr * scale, sched, model=dict(act=act, depth=depth)))
    cases += [Case("mlp-relu-adam-3e-3", "mlp", "adam", 3e-3, model=dict(act="relu"), seed=5),
              Case("mlp-gelu-adam-1e-2", "mlp", "adam", 1e-2, model=dict(act="gelu")),
              Case("mlp-tanh-adam-1e-2", "mlp", "adam", 1e-2, model=dict(act="tanh")),
              # small init: a plateau the net leaves, its gradient norm rising tenfold as the loss falls
              Case("mlp-plateau-gelu", "mlp", "adam", 3e-3, model=dict(act="gelu", depth=4, init=0.3), seed=1),
              Case("mlp-plateau-tanh", "mlp", "adam", 3e-3, model=dict(act="tanh", depth=4, init=0.3), seed=2),
              Case("mlp-plateau-tanh-sgd", "mlp", "sgdm", 0.1, model=dict(act="tanh", depth=4, init=0.7), seed=2),
              # a few units dead from initialization: ordinary attrition, not a pathology
              Case("mlp-relu-few-dead", "mlp", "adam", 1e-3, model=dict(act="relu", dead_at_init=3)),
              Case("mlp-relu-few-dead-sgd", "mlp", "sgdm", 0.05, model=dict(act="relu", dead_at_init=2), seed=3),
              Case("mlp-relu-clip", "mlp", "sgdm", 0.1, clip=1.0, seed=4),
              # a linear probe, then fine-tuning: the body frozen (no update at all) until step K
              Case("mlp-relu-lpft", "mlp", "adam", 1e-3, inject=("freeze", K, dict(keep="head")), seed=6),
              # rules 2.0's recipes: schedules, losses and data that move the numbers while training is healthy
              Case("mlp-relu-restarts", "mlp", "sgdm", 0.05, "restarts", seed=7),
              Case("mlp-gelu-one-cycle", "mlp", "adamw", 3e-3, "one-cycle", model=dict(act="gelu"), seed=8),
              Case("mlp-relu-label-smoothing", "mlp", "adam", 1e-3, recipe="smooth", seed=9),
              Case("mlp-tanh-mixup", "mlp", "adam", 3e-3, recipe="mixup", model=dict(act="tanh"), seed=10),
              # one corrupted batch (inputs ×30) at step K: a loss and gradient spike the run recovers from
              Case("mlp-relu-bad-batch", "mlp", "adam", 1e-3, recipe="bad-batch", seed=11),
              Case("mlp-gelu-curriculum", "mlp", "adam", 1e-3, recipe="curriculum", model=dict(act="gelu"), seed=12),
              Case("mlp-relu-staged-unfreeze", "mlp", "adam", 1e-3, inject=("stages", 0, dict(at=(60, 100, 140))),
                   seed=13),
              Case("cnn-bn-bad-batch", "cnn", "adam", 1e-3, recipe="bad-batch", seed=2),
              Case("transformer-restarts", "transformer", "adamw", 1e-3, "restarts", seed=3),
              # other losses: a VAE (reconstruction + KL), a contrastive encoder (InfoNCE over two noisy views)
              Case("vae-adam", "vae", "adam", 1e-3, seed=16), Case("vae-adamw-cosine", "vae", "adamw", 2e-3,
                                                                   "warmup-cosine", seed=17),
              Case("contrastive-adam", "contrastive", "adam", 1e-3, seed=18),
              Case("contrastive-sgdm", "contrastive", "sgdm", 0.05, seed=19),
              # soft-capped attention and output logits (Gemma 2: tanh caps at 50 and 30)
              Case("gemma2-adamw-cosine", "gemma2", "adamw", 2e-3, "warmup-cosine"),
              Case("gemma2-adam", "gemma2", "adam", 1e-3, seed=1)]
    cases += [Case("cnn-bn-sgdm", "cnn", "sgdm", 0.05), Case("cnn-bn-adam", "cnn", "adam", 1e-3),
              Case("cnn-bn-adamw-cosine", "cnn", "adamw", 3e-3, "warmup-cosine"),
              Case("cnn-bn-sgdm-clip", "cnn", "sgdm", 0.1, clip=1.0, seed=1)]
    cases += [Case("lstm-adam", "lstm", "adam", 3e-3), Case("lstm-adamw-clip", "lstm", "adamw", 3e-3, clip=1.0),
              Case("lstm-sgdm-clip", "lstm", "sgdm", 0.5, clip=1.0, seed=1)]
    cases += [Case("transformer-adamw-cosine", "transformer", "adamw", 1e-3, "warmup-cosine"),
              Case("transformer-adam", "transformer", "adam", 1e-3, seed=1),
              Case("transformer-prenorm-clip", "transformer", "adamw", 2e-3, clip=1.0, model=dict(norm_first=True))]
    for family in ("bert", "gpt2", "vit", "llama"):
        cases += [Case(f"{family}-adamw-cosine", family, "adamw", 2e-3, "warmup-cosine"),
                  Case(f"{family}-adam", family, "adam", 1e-3, seed=1),
                  Case(f"{family}-adamw-clip", family, "adamw", 3e-3, clip=1.0, seed=2)]
    return cases


K = 100  # the step pathologies are injected at, mid-run
PATHOLOGICAL = [
    Case("kill-relu2", "mlp", inject=("bias", K, dict(module="fc2", value=-100.0)),
         rules=("layer_dead", "dead_growing", "dead_high"), layers=("relu2",), at=K),
    Case("kill-half-relu1", "mlp", "sgdm", 0.05, inject=("bias", K, dict(module="fc1", value=-100.0, units=32)),
         rules=("layer_dead", "dead_growing", "dead_high"), layers=("relu1",), at=K, seed=1),
    Case("kill-bert-ffn", "bert", "adamw", 2e-3, inject=("bias", K, dict(
        module="bert.encoder.layer.1.intermediate.dense", value=-1e4, units=40)),
         rules=("layer_dead", "dead_growing", "dead_high"), layers=("*layer.1.intermediate*",), at=K),
    # one unit of fc2 killed every 10 steps from step 60: a layer dying slowly, never by much at once
    Case("dying-slow-relu2", "mlp", inject=("drip", 60, dict(module="fc2", value=-100.0, every=10)),
         rules=("dead_growing",), layers=("relu2",), at=60, window=True),
    Case("dying-relu-lr", "mlp", inject=("lr", K, dict(module="fc2", factor=300.0)),
         rules=("layer_dead", "dead_growing", "dead_high"), layers=("relu2", "relu3"), at=K),
    Case("saturate-tanh2", "mlp", model=dict(act="tanh"), inject=("bias", K, dict(module="fc2", value=6.0, add=True)),
         rules=("saturation_growing", "saturation_high", "saturation_spike", "units_pinned"), layers=("tanh2",), at=K),
    Case("lstm-forget-pinned", "lstm", "adam", 3e-3, inject=("bias", K, dict(module="lstm", value=12.0, gate=1)),
         rules=("saturation_growing", "saturation_high", "saturation_spike", "units_pinned"), layers=("lstm.l0.forget_gate",), at=K),
    Case("vanishing-deep-sigmoid", "mlp", "sgdm", 0.05, model=dict(act="sigmoid", depth=12, width=32),
         rules=("vanishing_gradients",), layers=("fc1", "fc2", "fc3"), at=0),
    Case("vanishing-shrunk", "mlp", "sgdm", 0.05, model=dict(act="tanh", depth=8, width=32),
         inject=("scale", K, dict(modules=[f"fc{i}" for i in range(2, 9)], factor=0.05)),
         rules=("vanishing_gradients",), layers=("fc1", "fc2"), at=K),
    # an LR ramp without clipping: in an MLP without normalization, in BERT and in GPT-2
    Case("exploding-unnormalized-mlp", "mlp", "sgdm", 0.02, model=dict(act="gelu"), inject=("ramp", K, dict(rate=1.06)),
         rules=("exploding_gradients", "nan_inf"), at=K, window=True),
    Case("exploding-bert-ramp", "bert", "sgdm", 0.05, inject=("ramp", K, dict(rate=1.08)),
         rules=("exploding_gradients", "nan_inf"), at=K, window=True),
    Case("exploding-gpt2-ramp", "gpt2", "sgdm", 0.05, inject=("ramp", K, dict(rate=1.08)),
         rules=("exploding_gradients", "nan_inf"), at=K, window=True),
    Case("nan-planted-fc2", "mlp", inject=("nan", K + 7, dict(module="fc2")), rules=("nan_inf",), layers=("fc2",),
         at=K + 7),
    # the loss goes NaN (a log(0) in it) at one step: every gradient with it, no activation
    Case("nan-loss-mlp", "mlp", inject=("loss", K + 5, dict(value=math.nan)), rules=("nan_inf",), layers=("loss",),
         at=K + 5),
    Case("inf-planted-cnn", "cnn", "sgdm", 0.05, inject=("nan", K + 3, dict(module="conv2", value=math.inf)),
         rules=("nan_inf",), layers=("conv2",), at=K + 3),
    Case("nan-planted-gpt2", "gpt2", "adamw", 2e-3, inject=("nan", K + 11, dict(module="transformer.h.1.mlp.c_fc")),
         rules=("nan_inf",), layers=("transformer.h.1.mlp.c_fc",), at=K + 11),
    # held out by rules 2.0: three ReLU layers killed by Adam at lr 0.3 (the cause: dead layers, not vanishing
    # gradients), and a bug multiplying every gradient by 1000 from step K (the loss hits ~100 at one step)
    Case("dead-adam-lr0.3", "mlp", "adam", 0.3, rules=("layer_dead", "dead_growing", "dead_high"),
         layers=("relu*", "fc*"), at=40, seed=14),
    # the same corrupted batch under SGD with momentum: its one huge step kills ReLU units (a data bug's damage)
    Case("bad-batch-kills-sgd", "mlp", "sgdm", 0.05, recipe="bad-batch", rules=("layer_dead", "dead_growing",
                                                                                 "dead_high"),
         layers=("relu2", "relu3"), at=K, seed=11),
    Case("grad-bug-x1000", "mlp", "sgdm", 0.05, recipe="grad-bug", rules=("exploding_gradients", "nan_inf"), at=K,
         window=True, seed=15),
    Case("dead-then-diverge", "mlp", "adam", 1e-3, inject=("ramp", 60, dict(rate=1.05)),
         rules=("layer_dead", "dead_growing", "dead_high", "exploding_gradients", "nan_inf"), at=60, window=True),
    # spec 1.3: units made to barely fire (not dead), attention and output logits grown step by step
    # (shrunk ×0.8 every step, relu2's units barely fire from ~step 140 and die by the end: dormant said on
    # the way by a live monitor, dead at the end; fc2's outputs are no activation's, read dormant by no rule)
    Case("dormant-relu2", "mlp", inject=("grow", K, dict(modules=["fc2"], rate=0.8, units=40)),
         rules=("dormant_units", "dead_growing"), layers=("relu2",), at=K, window=True),
    Case("qk-growth-llama", "llama", "adamw", 2e-3, inject=("grow", K, dict(modules=[
        f"model.layers.1.self_attn.{p}_proj" for p in "qk"], rate=1.03)),
         rules=("attention_logit_growth", "attention_entropy_collapse"), layers=("model.layers.1.self_attn.*",),
         at=K, window=True),
    # the same growth under Gemma 2's soft cap (50): the capped logits grow to the cap, then one-hot heads
    Case("qk-growth-gemma2", "gemma2", "adamw", 2e-3, inject=("grow", K, dict(modules=[
        f"model.layers.1.self_attn.{p}_proj" for p in "qk"], rate=1.03)),
         rules=("attention_logit_growth", "attention_entropy_collapse"), layers=("model.layers.1.self_attn.*",),
         at=K, window=True),
    Case("logit-drift-gpt2", "gpt2", "adamw", 2e-3, inject=("grow", K, dict(modules=["transformer.ln_f"], rate=1.04)),
         rules=("logit_divergence",), layers=("lm_head.*",), at=K, window=True),
]
CASES = _healthy() + PATHOLOGICAL


# -- data ---------------------------------------------------------------------------------------

def _tasks(torch, family: str, g):
    """batch(n) → (inputs, targets) and a fixed probe for a family's task: tabular classes from a
    random teacher, images from class templates, token sequences from one of four Markov chains
    (classified), or from one chain (next token)."""
    if family == "vae":  # 32 features spanned by 6 factors: what an 8-dimensional code can reconstruct
        mix = torch.randn(6, 32, generator=g) / 6 ** 0.5

        def batch(n):
            x = torch.randn(n, 6, generator=g) @ mix
            return x, x
    elif family in ("mlp", "contrastive"):
        teacher = torch.randn(32, 16, generator=g), torch.randn(16, CLASSES, generator=g)

        def batch(n):
            x = torch.randn(n, 32, generator=g)
            return x, (torch.tanh(x @ teacher[0]) @ teacher[1]).argmax(1)
    elif family in ("cnn", "vit"):
        templates = torch.randn(CLASSES, 1, 16, 16, generator=g)

        def batch(n):
            y = torch.randint(0, CLASSES, (n,), generator=g)
            return templates[y] + 1.5 * torch.randn(n, 1, 16, 16, generator=g), y
    else:
        chains = torch.softmax(3 * torch.randn(CLASSES, VOCAB, VOCAB, generator=g), -1)
        lm = family in LANGUAGE_MODELS

        def batch(n):
            y = torch.zeros(n, dtype=torch.long) if lm else torch.randint(0, CLASSES, (n,), generator=g)
            tokens = [torch.randint(0, VOCAB, (n,), generator=g)]
            for _ in range(SEQ - 1):
                tokens.append(torch.multinomial(chains[y, tokens[-1]], 1, generator=g).squeeze(1))
            x = torch.stack(tokens, 1)
            return (x, x) if lm else (x, y)
    return batch, batch(64)[0]


# -- models -------------------------------------------------------------------------------------

def build(torch, case: Case):
    """The model of a case's family, with its options."""
    nn, o = torch.nn, case.model
    if case.family == "vae":
        class VAE(nn.Module):
            """x → (fc1, relu1) → mu, logvar → z → (fc3, relu3, fc4) → x̂; z is mu in eval mode."""

            def __init__(self):
                super().__init__()
                self.fc1, self.relu1, self.stats = nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)
                self.fc3, self.relu3, self.fc4 = nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 32)

            def forward(self, x):
                mu, logvar = self.stats(self.relu1(self.fc1(x))).chunk(2, -1)
                z = mu + torch.randn_like(mu) * (0.5 * logvar).exp() if self.training else mu
                return self.fc4(self.relu3(self.fc3(z))), mu, logvar
        return VAE()
    if case.family == "contrastive":
        return build(torch, Case(case.name, "mlp", model=dict(out=16)))
    if case.family == "mlp":
        act = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}[o.get("act", "relu")]
        depth, width, inp = o.get("depth", 3), o.get("width", 64), 32
        names = []
        for i in range(1, depth + 1):
            names += [(f"fc{i}", nn.Linear(inp, width)), (f"{o.get('act', 'relu')}{i}", act())]
            inp = width
        model = nn.Sequential(OrderedDict(names + [("head", nn.Linear(width, o.get("out", CLASSES)))]))
        with torch.no_grad():
            for m in model:
                if isinstance(m, nn.Linear):
                    m.weight.mul_(o.get("init", 1.0))
            if o.get("dead_at_init"):
                model.fc1.bias[: o["dead_at_init"]] = -30.0
        return model
    if case.family == "cnn":
        return nn.Sequential(OrderedDict(conv1=nn.Conv2d(1, 8, 3, padding=1), bn1=nn.BatchNorm2d(8), relu1=nn.ReLU(),
                                  conv2=nn.Conv2d(8, 16, 3, stride=2, padding=1), bn2=nn.BatchNorm2d(16),
                                  relu2=nn.ReLU(), pool=nn.AdaptiveAvgPool2d(1), flat=nn.Flatten(),
                                  head=nn.Linear(16, CLASSES)))
    if case.family == "lstm":
        class Tagger(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb, self.lstm, self.head = nn.Embedding(VOCAB, 16), nn.LSTM(16, 32, batch_first=True), \
                    nn.Linear(32, CLASSES)

            def forward(self, x):
                return self.head(self.lstm(self.emb(x))[0][:, -1])
        return Tagger()
    if case.family == "transformer":
        class Encoder(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb, self.pos = nn.Embedding(VOCAB, 32), nn.Parameter(0.02 * torch.randn(SEQ, 32))
                layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.1, batch_first=True,
                                                   norm_first=o.get("norm_first", False))
                self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
                self.head = nn.Linear(32, CLASSES)

            def forward(self, x):
                return self.head(self.encoder(self.emb(x) + self.pos).mean(1))
        return Encoder()
    import transformers as tf

    tf.logging.set_verbosity_error()  # tiny vocabularies: GPT-2's default special-token ids are out of range
    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    if case.family == "bert":
        return tf.BertForSequenceClassification(tf.BertConfig(vocab_size=VOCAB, max_position_embeddings=SEQ,
                                                              num_labels=CLASSES, **small))
    if case.family == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2))
    if case.family == "vit":
        return tf.ViTForImageClassification(tf.ViTConfig(image_size=16, patch_size=4, num_channels=1,
                                                         num_labels=CLASSES, **small))
    if case.family == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=VOCAB, max_position_embeddings=SEQ,
                                                  num_key_value_heads=2, **small))
    if case.family == "gemma2":
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(vocab_size=VOCAB, max_position_embeddings=SEQ, num_key_value_heads=2,
                                                    head_dim=16, attn_logit_softcapping=50.0,
                                                    final_logit_softcapping=30.0, attn_implementation="eager", **small))
    raise ValueError(f"unknown family {case.family!r}")


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def loss_of(torch, case: Case, model, x, y):
    f = torch.nn.functional
    if case.family == "vae":  # reconstruction + KL to the unit normal
        recon, mu, logvar = model(x)
        return f.mse_loss(recon, x) + 0.01 * (-0.5 * (1 + logvar - mu ** 2 - logvar.exp()).sum(-1)).mean()
    if case.family == "contrastive":  # InfoNCE: each example's second view among the batch's
        z1, z2 = (f.normalize(model(x + 0.3 * torch.randn_like(x)), dim=-1) for _ in range(2))
        return f.cross_entropy(z1 @ z2.T / 0.2, torch.arange(len(x)))
    smoothing = 0.1 if case.recipe == "smooth" else 0.0
    if case.recipe == "mixup" and model.training:  # inputs and targets mixed with a shuffled copy of the batch
        lam, perm = 0.7, torch.randperm(len(x))
        logits = _logits(model(lam * x + (1 - lam) * x[perm]))
        ce = torch.nn.functional.cross_entropy
        return lam * ce(logits, y) + (1 - lam) * ce(logits, y[perm])
    logits = _logits(model(x))
    if case.family in LANGUAGE_MODELS:  # next token
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), y[:, 1:].reshape(-1),
                                                 label_smoothing=smoothing)
    return torch.nn.functional.cross_entropy(logits, y, label_smoothing=smoothing)


# -- training -----------------------------------------------------------------------------------

def _optimizer(torch, case: Case, model):
    """One parameter group per top-level module, so an injection can change one layer's rate (a
    parameter tied into two modules, GPT-2's embedding and head, in the first)."""
    seen, groups = set(), []
    for name, module in [*model.named_children(), ("", model)]:
        params = [p for p in (module.parameters() if name else model.parameters(recurse=False)) if id(p) not in seen]
        seen |= {id(p) for p in params}
        groups += [{"params": params, "name": name}] if params else []
    if case.optimizer == "sgdm":
        return torch.optim.SGD(groups, lr=case.lr, momentum=0.9)
    return (torch.optim.AdamW if case.optimizer == "adamw" else torch.optim.Adam)(groups, lr=case.lr)


def _schedule(case: Case, step: int) -> float:
    if case.schedule == "restarts":  # cosine annealing, restarted every 50 steps
        return 0.5 * (1 + math.cos(math.pi * (step % 50) / 50))
    if case.schedule == "one-cycle":  # up to 10× over the first 30 %, then annealed to 0
        peak = int(0.3 * STEPS)
        return 0.1 + 0.9 * step / peak if step < peak else 0.5 * (1 + math.cos(math.pi * (step - peak) / (STEPS - peak)))
    if case.schedule == "warmup-cosine":
        warm = STEPS // 10
        return (step + 1) / warm if step < warm else 0.5 * (1 + math.cos(math.pi * (step - warm) / (STEPS - warm)))
    return 1.0


def _inject(torch, case: Case, step: int, model, opt, base_lrs) -> None:
    """Apply the case's pathology at its step (a ramp, a growth and a drip every step after; a freeze from
    the start until then; a loss made NaN: in `train`)."""
    if not case.inject:
        return
    what, at, o = case.inject
    if what == "stages":  # the head alone first, then one more block from the top at each of `at`
        blocks = sorted({name.split(".")[0] for name, _ in model.named_parameters()} - {"head"}, reverse=True)
        if step == 0 or step in o["at"]:
            thawed = {"head", *blocks[: sum(step >= a for a in o["at"])]}
            for name, p in model.named_parameters():
                p.requires_grad_(name.split(".")[0] in thawed)
        return
    if what == "freeze":  # every module but `keep` frozen from the start until `at`
        if step in (0, at):
            for name, p in model.named_parameters():
                p.requires_grad_(step == at or name.startswith(o["keep"] + "."))
        return
    if step < at or (step > at and what not in ("ramp", "grow", "drip")) or (what == "drip" and (step - at) % o["every"]):
        return
    with torch.no_grad():
        if what == "drip":  # the next unit of the module, every `every` steps
            model.get_submodule(o["module"]).bias[(step - at) // o["every"]] = o["value"]
        elif what == "bias":
            module = model.get_submodule(o["module"])
            bias = getattr(module, "bias", None) if "gate" not in o else module.bias_ih_l0
            rows = slice(0, o.get("units")) if "gate" not in o else \
                slice(o["gate"] * module.hidden_size, (o["gate"] + 1) * module.hidden_size)
            bias[rows] = bias[rows] + o["value"] if o.get("add") or "gate" in o else o["value"]
        elif what in ("scale", "grow"):  # the first `units` output units, or all; a growth at every step,
            for name in o["modules"]:    # whatever training does: logits grow, units fade
                module = model.get_submodule(name)
                for p in (module.weight, getattr(module, "bias", None)):
                    if p is not None:
                        p[: o.get("units")].mul_(o["factor"] if what == "scale" else o["rate"])
        elif what == "nan":
            model.get_submodule(o["module"]).weight.view(-1)[0] = o.get("value", math.nan)
        elif what == "lr":
            for i, group in enumerate(opt.param_groups):
                if group["name"] == o["module"]:
                    base_lrs[i] *= o["factor"]
        elif what == "ramp":
            for i in range(len(base_lrs)):
                base_lrs[i] *= o["rate"]


def train(case: Case, out: Path) -> Path:
    """Train one case, recording it with the PyTorch Monitor (loss and learning rate logged every
    step); returns the trace's path."""
    import torch

    from actrace.adapters.torch import Monitor

    torch.manual_seed(case.seed)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1000 + case.seed)
    batch, probe = _tasks(torch, case.family, g)
    model = build(torch, case)
    opt = _optimizer(torch, case, model)
    base_lrs = [group["lr"] for group in opt.param_groups]
    config = dict(corpus=VERSION, family=case.family, optimizer=case.optimizer, lr=case.lr, schedule=case.schedule,
                  recipe=case.recipe, clip=case.clip,
                  healthy=case.healthy, inject=list(case.inject[:2]) if case.inject else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Monitor(model, probe, out, run=case.name, probe_every=PROBE_EVERY, config=config,
                     overwrite=True) as mon:
            for step in range(STEPS + 1):
                _inject(torch, case, step, model, opt, base_lrs)
                for group, lr in zip(opt.param_groups, base_lrs):
                    group["lr"] = lr * _schedule(case, step)
                x, y = batch(BATCH)
                if case.recipe == "bad-batch" and step == K:
                    x = x * 30.0 if x.is_floating_point() else x  # one corrupted batch
                if case.recipe == "curriculum" and step >= K:
                    x = 1.5 * x + 0.5  # the data distribution shifts (the probe stays the same)
                model.train()
                loss = loss_of(torch, case, model, x, y)
                if case.inject and case.inject[0] == "loss" and step == case.inject[1]:
                    loss = loss * case.inject[2]["value"]
                opt.zero_grad()
                loss.backward()
                if case.recipe == "grad-bug" and step >= K:
                    for p in model.parameters():
                        if p.grad is not None:
                            p.grad.mul_(1000.0)
                mon.step(step)
                mon.log(step, loss=loss, lr=opt.param_groups[0]["lr"])
                if case.clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
                opt.step()
    return out
