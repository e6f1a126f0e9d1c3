"""Load a DLM checkpoint, compute the masked-diffusion loss of a sentence and sample from it.

    python examples/usage.py outputs/quickstart
"""

import argparse

import torch
from transformers import AutoModelForMaskedLM, AutoTokenizer

import hf_dlm  # noqa: F401  (registers model_type "dlm" with the Auto classes)
from hf_dlm import MaskedDiffusionObjective


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="checkpoint folder (model + tokenizer)")
    parser.add_argument("--prompt", default="The little girl")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    model = AutoModelForMaskedLM.from_pretrained(args.path)
    tokenizer = AutoTokenizer.from_pretrained(args.path)

    objective = MaskedDiffusionObjective.from_model_config(model.config, preset="mdlm")
    batch = tokenizer(["The old man walked to the market in the morning."] * 8, return_tensors="pt")
    loss, inputs = objective(model, batch["input_ids"], sample_index=torch.arange(8))  # t in 8 strata of [0, 1)
    print(f"NELBO {loss.item():.3f} nats per token ({int(inputs['masked'].sum())} of "
          f"{int(inputs['supervised'].sum())} tokens masked)")

    model.eval()
    prompt = tokenizer(args.prompt, return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=args.max_new_tokens, steps=args.max_new_tokens,
                         block_length=args.max_new_tokens // 2, temperature=0.0)
    completion = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"{args.prompt!r} -> {completion!r}")
    return out


if __name__ == "__main__":
    main()
