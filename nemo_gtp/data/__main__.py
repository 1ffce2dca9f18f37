"""``python -m nemo_gtp.data``: train a tokenizer, build indexed data (see the package docs).

Examples::

    python -m nemo_gtp.data tokenizer --input corpus.jsonl --output data/tok --vocab-size 8000
    python -m nemo_gtp.data build --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer sentencepiece:data/tok.model
"""

from __future__ import annotations

import argparse
import sys

PROG = "python -m nemo_gtp.data"


def build_parser() -> argparse.ArgumentParser:
    """The two subcommands and their options (``python -m nemo_gtp.data build --help``)."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Build megatron indexed datasets (.bin/.idx) from a local corpus."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    inputs = dict(
        action="append",
        required=True,
        metavar="PATH",
        help="a .jsonl file (one JSON object per line), a text file (one document) or a "
        "directory of them; repeat for more",
    )
    key = dict(default="text", help="the text field of JSONL lines (default: text)")
    build = sub.add_parser("build", help="tokenize a corpus into PREFIX.bin / PREFIX.idx")
    build.add_argument("--input", **inputs)
    build.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    build.add_argument(
        "--tokenizer",
        required=True,
        help="sentencepiece:PATH.model, huggingface:NAME_OR_DIR or byte (the recipe must use "
        "the same one)",
    )
    build.add_argument("--json-key", **key)
    build.add_argument(
        "--no-eod", action="store_true", help="do not append the end-of-document token"
    )
    train = sub.add_parser("tokenizer", help="train a SentencePiece BPE tokenizer on a corpus")
    train.add_argument("--input", **inputs)
    train.add_argument("--output", required=True, help="writes OUTPUT.model and OUTPUT.vocab")
    train.add_argument("--vocab-size", type=int, default=8000)
    train.add_argument("--json-key", **key)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (2: bad input, one ``error:`` line).

    Example::

        main(["build", "--input", "corpus.jsonl", "--output-prefix", "data/corpus",
              "--tokenizer", "byte"])
    """
    args = build_parser().parse_args(argv)
    try:
        if args.command == "tokenizer":
            from nemo_gtp.data.tokenizers import train_sentencepiece

            model = train_sentencepiece(args.input, args.output, args.vocab_size, args.json_key)
            print(f"wrote {model} (use --tokenizer sentencepiece:{model})", flush=True)
            return 0
        from nemo_gtp.data.indexed import build_indexed_dataset
        from nemo_gtp.data.tokenizers import load_tokenizer, parse_spec

        parse_spec(args.tokenizer)  # a bad spec fails before NeMo is imported
        stats = build_indexed_dataset(
            args.input,
            args.output_prefix,
            load_tokenizer(args.tokenizer),
            json_key=args.json_key,
            append_eod=not args.no_eod,
        )
    except ValueError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr, flush=True)
        return 2
    print(
        f"wrote {stats['prefix']}.bin/.idx: {stats['documents']} documents, "
        f"{stats['tokens']} tokens ({stats['dtype']})",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
