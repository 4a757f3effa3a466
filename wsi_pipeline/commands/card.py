"""``wsi-pipeline card init MODEL.onnx`` and ``wsi-pipeline card check CARD``: a card for one's own model."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "card",
        help="write a first model card for an ONNX model, or check a card",
        description="init: write MODEL.card.json from what the ONNX file says (input and output names, "
        "shapes, dtypes, a layout guess, SHA-256); the fields it cannot know (decoder, classes, mpp; "
        'mean/std of a float input) are left as "TODO: ..." strings to fill in (docs/model_card.md). '
        "check: validate a card (no TODO left, every field, the SHA-256, the graph against the card, "
        "the decoder's parameters) and run one blank tile through ONNX Runtime and the decoder.",
    )
    sub = p.add_subparsers(dest="card_command", metavar="ACTION", required=True)
    init = sub.add_parser(
        "init",
        help="write a first card for an ONNX model",
        description="Write a first card for MODEL (see wsi-pipeline card --help).",
    )
    init.add_argument("model", metavar="MODEL.onnx", help="the ONNX model")
    init.add_argument(
        "--out", metavar="CARD", default=None, help="card to write (default: MODEL with .card.json, beside it)"
    )
    init.add_argument("--name", default=None, help="the model's name in the card (default: the file's stem)")
    init.add_argument("--force", action="store_true", help="replace an existing card")
    init.set_defaults(func=run_init)
    check = sub.add_parser(
        "check",
        help="validate a card against its model",
        description="Validate CARD (see wsi-pipeline card --help); exit 0 when it is "
        "ready for wsi-pipeline run --model CARD, 1 otherwise.",
    )
    check.add_argument("card", metavar="CARD", help="the card (NAME.card.json) or the model beside it")
    check.add_argument(
        "--no-run", action="store_true", help="skip running one blank tile through the model and the decoder"
    )
    check.set_defaults(func=run_check)


def run_init(args: argparse.Namespace) -> int:
    from ..inference.card_init import write_draft_card

    path, todo = write_draft_card(args.model, args.out, name=args.name, force=args.force)
    print(f"wrote {path}")
    if todo:
        print(f"fill in: {', '.join(todo)} (docs/model_card.md), then: wsi-pipeline card check {path}")
    return 0


def run_check(args: argparse.Namespace) -> int:
    from ..inference.card import card_path_for
    from ..inference.card_init import check_card
    from ..inference.card_spec import CARD_SUFFIX

    path = args.card if args.card.endswith((CARD_SUFFIX, ".json")) else str(card_path_for(args.card))
    card = check_card(path, run=not args.no_run)
    h, w = card.input.size_hw
    mpp = f"{card.mpp} um/px" if card.mpp is not None else "no mpp (level 0 as it is)"
    print(
        f"{path}: ok: {card.name} {card.version} ({card.precision}), {card.input.dtype} {card.input.layout} "
        f"{h} x {w}, {mpp}, decoder {card.decoder.type}, classes {', '.join(card.class_names)}"
        + (f", heatmap {', '.join(card.heatmap.classes)}" if card.heatmap else "")
    )
    return 0
