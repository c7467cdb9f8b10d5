"""Captured decode steps (DESIGN §8; schema in docs/capture-format.md).

One capture = one decode step of one layer on one rank: a safetensors file whose metadata key
``k3verify`` holds the JSON manifest. A capture *set* is the folder holding every rank of one
(step, layer)::

    ROOT/weights/<sha256>.safetensors          content-addressed weights (source "stored")
    ROOT/s00003_l002/rank0.safetensors         step 3, layer 2, rank 0

The package, by job:
    format      constants, dtypes, poison, hashing, the strict safetensors header
    validate    the one place a capture's input is parsed and checked (ref.abi's launch rule)
    sources     weight sources (stored / recipe / checkpoint), verification, the WeightCache
    checkpoint  the checkpoint-reference source (Kimi-K3's HF names, TP slices)
    slots       state compaction: slot maps, the slots a step reads and writes
    writer      StepRecord, write_capture, store_weights
    loader      load_capture, load_set, CaptureSet, Untouched, discover
    producer    the manifest's producer block (versions, git revision, read-only)
"""
from __future__ import annotations

from ref import abi

from . import checkpoint, format, loader, slots, sources, validate, writer  # noqa: F401
from .checkpoint import checkpoint_source
from .format import (DENSE_AFTER, DTYPES, FORMAT, K1_AFTER, K1_KINDS, K1_STATE, K1_WEIGHTS, K2_AFTER, K2_STATE,
                     K2_WEIGHTS, KINDS, META_KEY, POISON_BITS, POISON_FINITE, READS, SCHEMA, SLOT_MAP, WEIGHT_LAYOUT,
                     WEIGHTS_FORMAT, Header, canon, dtype_name, poison_, read_header, same_bits, tensor_sha256)
from .loader import Capture, CaptureSet, Untouched, discover, load_capture, load_set, load_sets
from .producer import device_name, git_revision, producer, versions
from .slots import compact_cache, conv_layout_of, remap_st_idx, slot_map_for, step_slots
from .sources import (CACHE, CACHE_ENV, SOURCES, VERIFY, WeightCache, WeightHasher, entries_of, load_weights,
                      recipe_entry, recipe_source, store_weights, stored_entry, weights_address)
from .writer import StepRecord, capture_bytes, capture_path, set_dirname, write_capture, write_new


def _read_header(path) -> tuple[dict, dict]:
    """(safetensors tensor header, manifest) of a file, strictly read (the old module's helper)."""
    h = read_header(path)
    return h.tensors, h.manifest()


def _write_new(path, tensors: dict, manifest: dict, exist_ok: bool = False) -> None:
    write_new(path, tensors, manifest, exist_ok)


__all__ = ["FORMAT", "SCHEMA", "READS", "POISON_BITS", "POISON_FINITE", "StepRecord", "Capture", "CaptureSet",
           "Untouched", "WeightHasher", "WeightCache", "CACHE", "CACHE_ENV", "write_capture", "store_weights",
           "stored_entry", "recipe_source", "recipe_entry", "checkpoint_source", "load_capture", "load_set", "load_sets",
           "load_weights", "discover", "capture_path", "set_dirname", "slot_map_for", "compact_cache", "remap_st_idx",
           "conv_layout_of", "step_slots", "tensor_sha256", "poison_", "same_bits", "producer", "versions",
           "git_revision", "dtype_name", "weights_address", "capture_bytes", "K1_KINDS", "KINDS", "K1_STATE",
           "K1_WEIGHTS", "K1_AFTER", "K2_STATE", "K2_WEIGHTS", "K2_AFTER", "DENSE_AFTER", "META_KEY", "SOURCES",
           "VERIFY", "read_header", "Header"]
