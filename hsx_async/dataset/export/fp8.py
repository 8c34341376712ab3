"""FP8 in an export (PROTOCOL §4): which dtype a format that reads FP8 gets, and which of
its slots the export quantizes itself. The dataset's own FP8 bytes are handed on where they
hold what the trainer reads; a slot with no FP8 bytes (kept in bfloat16, every slot of a
bfloat16 dataset, every slot of an FP8 layout other than the one the trainer reads) or
with new values (a converted final state) is quantized by the one quantizer
(:mod:`hsx_async.quantize`)."""

from __future__ import annotations

from hsx_async.dataset.export.plan import DatasetFacts, FinalConversion
from hsx_async.errors import DatasetError
from hsx_async.protocol import BF16, FP8, PER_TOKEN_SLOT, POST_NORM, PRE_NORM, Storage


def requantized_slots(storage: Storage, layers: int, conv: FinalConversion) -> tuple[int, ...]:
    """The slots a speculators FP8 export quantizes itself, having no FP8 bytes for what
    speculators reads: every slot of a bfloat16 dataset or of an FP8 layout other than
    ``per_token_slot`` (the one scale per vector, and nothing else, that FP8Transfer
    reads), the slots an FP8 dataset keeps in bfloat16, and the final slot when it is
    converted (new values: a second FP8 rounding). Empty: the dataset's FP8 bytes are the
    export's."""
    if not storage.is_fp8 or storage.scales != PER_TOKEN_SLOT:
        return tuple(range(layers))
    redo = set(storage.kept(layers))
    if conv.gain is not None:
        redo.add(layers - 1)
    return tuple(sorted(redo))


def fp8_export_problem(storage: Storage, layers: int, conv: FinalConversion) -> str:
    """Why ``--dtype auto`` writes a speculators export of this dataset in bfloat16 ('' if
    the dataset's FP8 bytes are the export's)."""
    if not storage.is_fp8:
        return "the dataset stores bfloat16"
    why = []
    if storage.scales != PER_TOKEN_SLOT:
        why.append(
            f"the dataset keeps each vector's {storage.outliers} largest values exact beside "
            f"its FP8 values (scales {storage.scales}), and speculators' FP8Transfer reads "
            "one scale per token and layer and nothing else: FP8 for it is quantized again "
            "from the values, and the vectors of attention-sink tokens, whose few massive "
            "channels then set their scale, keep few bits in the rest"
        )
    if storage.kept(layers):
        kept = ",".join(map(str, storage.kept(layers)))
        why.append(
            f'the dataset keeps slot(s) {kept} in bfloat16 ([output].quantize = "aux"), '
            "and speculators' FP8 file holds every slot as FP8"
        )
    if conv.gain is not None:
        why.append(
            f"the dataset holds the {POST_NORM} final state and speculators reads the "
            f"{PRE_NORM} one: converting it gives new values, which FP8 would quantize again"
        )
    if not why:
        return ""
    redo = ",".join(map(str, requantized_slots(storage, layers, conv)))
    return "; ".join(why) + f" (--dtype {FP8} writes FP8 anyway, quantizing slot(s) {redo} here)"


def fp8_dtype_rule(asked: str, facts: DatasetFacts, conv: FinalConversion) -> tuple[str, str]:
    """The dtype rule of a format that reads FP8: ``auto`` hands on the dataset's FP8 bytes
    when they are what the trainer reads (else bfloat16, and why, for an FP8 dataset);
    ``float8_e4m3fn`` always, quantizing the slots without them."""
    if asked == BF16:
        return BF16, ""
    if not facts.layers:
        if asked == FP8:
            raise DatasetError(f"--dtype {FP8}: the dataset is empty; export with --dtype auto")
        return BF16, ""
    problem = fp8_export_problem(facts.storage, facts.layers, conv)
    if not problem or asked == FP8:  # FP8: the slots with new values quantized here
        return FP8, ""
    return BF16, problem if facts.storage.is_fp8 else ""
