"""``hivetrain generate DIR --prompt TEXT``: continue a prompt with an exported model (``hivetrain export``).

A thin wrapper over ``transformers.pipeline("text-generation", model=DIR)``: the directory must hold the model and
its tokenizer, which ``hivetrain export`` writes. Nothing is downloaded (local files only).

Exit codes: 0 ok, 1 the model could not be loaded or generation failed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hivetrain generate", description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path, help="an exported model directory (hivetrain export --out DIR)")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (> 0)")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (deterministic)"
    )
    parser.add_argument("--top-k", type=int, default=50, help="sample from the k most likely tokens (temperature > 0)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    parser.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto", help="where to run (auto = cuda if available)"
    )
    return parser


def generate(
    model_dir: Path | str,
    prompt: str,
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 50,
    seed: int = 0,
    device: str = "cpu",
) -> str:
    """The prompt followed by up to ``max_new_tokens`` generated tokens, as text.

    Raises:
        ValueError: a non-positive ``max_new_tokens``, a negative temperature, a directory without a model and
            tokenizer ``transformers`` can load locally, or a prompt as long as the model's positions (longer
            generations stop at the model's ``max_position_embeddings``, with a warning).
    """
    import torch
    from transformers import pipeline

    if max_new_tokens <= 0 or temperature < 0:
        raise ValueError(f"max_new_tokens ({max_new_tokens}) must be > 0 and temperature ({temperature}) >= 0")
    if not Path(model_dir).is_dir():
        raise ValueError(f"{model_dir} is not a directory (export one with `hivetrain export CKPT --out DIR`)")
    try:
        generator = pipeline("text-generation", model=str(model_dir), device=device)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{model_dir}: cannot load a model and tokenizer from it ({exc})") from None
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": top_k} if temperature > 0 else {"do_sample": False}
    )
    limit = getattr(generator.model.config, "max_position_embeddings", None)
    if isinstance(limit, int) and limit > 0:  # positions past the model's are garbage (or an index error)
        num_prompt = len(generator.tokenizer(prompt)["input_ids"])
        if num_prompt >= limit:
            raise ValueError(f"the prompt is {num_prompt} tokens; this model reads at most {limit}: shorten it")
        if num_prompt + max_new_tokens > limit:
            logger.warning("generating %d tokens, not %d: the model reads at most %d positions and the prompt is %d",
                           limit - num_prompt, max_new_tokens, limit, num_prompt)  # fmt: skip
            max_new_tokens = limit - num_prompt
    torch.manual_seed(seed)
    out = generator(prompt, max_new_tokens=max_new_tokens, **sampling)
    return out[0]["generated_text"]


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2)
        return int(exc.code or 0)
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        text = generate(
            args.model_dir,
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed,
            device=device,
        )
    except ValueError as exc:
        print(f"hivetrain generate: {exc}", file=sys.stderr)
        return 1
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
