"""`pdmesh make-tiny-model OUT`: a tiny random model folder (``models.tiny``), trained
briefly on the local corpus with ``--train`` and its MTP layer distilled with
``--train-mtp`` (``training``: they run the engine, so the command sits above both)."""

from __future__ import annotations

import argparse

from pdmesh.shared.models.tiny import ARCHS, SIZES, make_tiny_model
from pdmesh.shared.training.lm import LmTraining, train_model
from pdmesh.shared.training.mtp import MtpTraining, train_mtp


def add_args(m: argparse.ArgumentParser) -> None:
    m.add_argument("out")
    m.add_argument("--arch", choices=list(ARCHS), default="qwen3")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--size", choices=list(SIZES), default="tiny")
    m.add_argument("--expert-skew", type=float, default=0.0,
                   help="MoE archs: bias each layer's router toward a quarter of its "
                        "experts (0: off; 0.3 sends them about 2/3 of the routed tokens)")
    m.add_argument("--train", action="store_true",
                   help="train the model briefly on the tokenizer's corpus (next-token "
                        "prediction), so its text is predictable as a real model's is "
                        "(not deepseek_v4; a few minutes on 2 CPU cores)")
    m.add_argument("--train-steps", type=int, default=None,
                   help="--train: optimizer steps (default 300)")
    m.add_argument("--train-mtp", action="store_true",
                   help="deepseek_v3: distil the MTP layer from the model's own greedy "
                        "continuations (a draft head for --speculative-config "
                        "'{\"method\": \"deepseek_mtp\"}' that gets accepted; a few "
                        "minutes on 2 CPU cores)")


def run(a: argparse.Namespace) -> int:
    if a.train_mtp and a.arch != "deepseek_v3":
        raise SystemExit(f"--train-mtp: needs --arch deepseek_v3 (the tiny model with an MTP "
                         f"layer), got {a.arch}")
    if a.train and a.arch == "deepseek_v4":
        raise SystemExit("--train: not for --arch deepseek_v4 (its attention has no training "
                         "path here)")
    if a.train_steps is not None and (not a.train or a.train_steps < 1):
        raise SystemExit(f"--train-steps: needs --train and a count >= 1, got {a.train_steps}")
    out = make_tiny_model(a.out, a.arch, seed=a.seed, size=a.size, expert_skew=a.expert_skew)
    print(f"wrote {a.size} {a.arch} model (seed {a.seed}) to {out}")
    if a.train:
        settings = LmTraining(seed=a.seed)
        if a.train_steps is not None:
            settings.steps = a.train_steps
        before, after = train_model(out, settings)
        print(f"trained it on the corpus: held-out loss {before:.2f} -> {after:.2f} nats/token")
    if a.train_mtp:
        before, after = train_mtp(out, MtpTraining(seed=a.seed))
        print(f"trained its MTP layer: agrees with the model's greedy next token "
              f"{100 * before:.0f}% -> {100 * after:.0f}% (held out)")
    return 0
