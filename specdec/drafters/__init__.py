"""Drafters, one file each, all behind `Drafter.propose`."""
from specdec.drafters.base import Draft, Drafter

SPEC_TYPES = ("none", "draft", "ngram-simple")

__all__ = ["Draft", "Drafter", "SPEC_TYPES"]
