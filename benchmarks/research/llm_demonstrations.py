"""Demonstrations before the review template, chosen on held-out training sentences (never on validation).

In-context demonstrations (LM-BFF's, Gao et al. 2021) put one labelled example of each class before the prompt::

    Review: <a negative training phrase>
    Sentiment: negative

    Review: <a positive training phrase>
    Sentiment: positive

    Review: {sentence}
    Sentiment:

For each candidate pair (the first, second, ... negative and positive training phrases of a length band, outside the
held-out slice; both orders) this prints the embedded LLM's zero-shot accuracy on the held-out slice of
`benchmarks/research/llm_learning_curve.py --heldout 400 --heldout_min_words 12`, the accuracy at the best threshold
on the two
label words' score difference (what correcting the words' bias alone reaches: ZO's first steps do that), and the
prompt's added tokens, then writes them to `--output`::

    python -m benchmarks.research.llm_demonstrations --output /tmp/demonstrations.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.common import SST2_DIR
from benchmarks.research.llm_learning_curve import TEMPLATES, best_threshold_accuracy, load_data
from hf_zo.models import embedded_llm_path
from hf_zo.prompts import PromptClassification

TEMPLATE, LABEL_WORDS = TEMPLATES["review"]
BANDS = ((6, 12), (12, 25))  # the demonstrations' length in words


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default=str(SST2_DIR), help="Folder with train.tsv and validation.tsv.")
    parser.add_argument("--model", default=None, help="Model path (default: the embedded LLM).")
    parser.add_argument("--pairs", type=int, default=3, help="Candidate pairs per length band.")
    parser.add_argument("--heldout", type=int, default=400)
    parser.add_argument("--heldout_min_words", type=int, default=12)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--output", default="llm_demonstrations.json", help="Where the JSON goes.")
    options = parser.parse_args()
    # what `llm_learning_curve.load_data` reads besides these
    options.dataset, options.train_min_words, options.num_train = "sst2", 0, 8192
    return options


def demonstration(sentence: str, label: int) -> str:
    """One labelled example in the template's own form."""
    return TEMPLATE.format(sentence=sentence.strip()) + LABEL_WORDS[label] + "\n\n"


def candidates(pool, pairs: int):
    """(band, index, order, prefix) of every candidate: the `index`-th phrase of each class in each band, the
    negative first (`"np"`) or the positive first (`"pn"`)."""
    words = [len(sentence.split()) for sentence in pool["sentence"]]
    for low, high in BANDS:
        by_label = [
            [i for i, n in enumerate(words) if low <= n <= high and pool[i]["label"] == label][:pairs]
            for label in (0, 1)
        ]
        for index in range(pairs):
            negative = demonstration(pool[by_label[0][index]]["sentence"], 0)
            positive = demonstration(pool[by_label[1][index]]["sentence"], 1)
            yield (low, high), index, "np", negative + positive
            yield (low, high), index, "pn", positive + negative


def main() -> None:
    options = parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    path = options.model or embedded_llm_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    pool, heldout, description = load_data(options)
    labels = torch.tensor(heldout["label"])
    results = []
    for band, index, order, prefix in [((0, 0), 0, "", ""), *candidates(pool, options.pairs)]:
        task = PromptClassification(tokenizer, prefix + TEMPLATE, LABEL_WORDS)
        scores = task.predict_scores(model, task.tokenize(heldout), batch_size=32)
        accuracy = float((scores.argmax(-1) == labels).float().mean())
        calibrated = best_threshold_accuracy(scores, labels)
        results.append(
            {
                "band_words": list(band),
                "index": index,
                "order": order,
                "prefix_tokens": len(tokenizer(prefix, add_special_tokens=False)["input_ids"]),
                "accuracy": round(accuracy, 4),
                "best_threshold_accuracy": round(calibrated, 4),
                "prefix": prefix,
            }
        )
        print(json.dumps({k: v for k, v in results[-1].items() if k != "prefix"}), flush=True)
    with open(options.output, "w") as file:
        json.dump({"evaluated_on": description, "results": results}, file, indent=1)
    print(f"wrote {options.output}")


if __name__ == "__main__":
    main()
