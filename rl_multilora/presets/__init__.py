"""Offline presets for `rl-multilora provision`: synthetic tasks and the tiny pretrained base.

`tiny_tasks` generates the three synthetic tasks (GSM8K-style word problems, arithmetic, number comparison) and
their format/correctness checks; `tiny` builds the tokenizer, pretrains the small causal LM and measures it.
"""
