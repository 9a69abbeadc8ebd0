"""Vote algorithms, one module each, behind :class:`~lioncub_ds.comm.base.VoteAlgorithm`."""
from .allgather import AllGatherVote
from .bbit import BBitVote
from .base import BucketKernels, Collectives, VoteAlgorithm, VoteJob
from .int8 import Int8Vote
from .onebit import OneBitVote
from .pbit import PBitVote


def make_algorithm(name: str, *, pbit_bits=None, vote_bits=2, rounding="dither", quant="l1") -> VoteAlgorithm:
    if name == "allgather":
        return AllGatherVote()
    if name == "1bit":
        return OneBitVote()
    if name == "pbit":
        return PBitVote(pbit_bits)
    if name == "int8":
        return Int8Vote(quant)
    if name == "bbit":
        return BBitVote(vote_bits, rounding, quant)
    raise ValueError(f"unknown comm algorithm {name!r}")


__all__ = ["AllGatherVote", "BBitVote", "BucketKernels", "OneBitVote", "PBitVote", "Int8Vote", "Collectives",
           "VoteAlgorithm", "VoteJob", "make_algorithm"]
