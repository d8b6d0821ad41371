"""Prompt lengths of a real caption set in Chroma's T5 tokens: the file ``train_step.py
--caption-lengths`` draws each step's 3 prompt lengths from (CPU only, no GPU).

    python benchmarks/caption_lengths.py iiw-p5b --out benchmarks/captions/iiw_p5b.json
    python benchmarks/caption_lengths.py coco-val2017 --input captions_val2017.json \\
        --out benchmarks/captions/coco_val2017.json
    python benchmarks/caption_lengths.py hf --hf-dataset OWNER/NAME --hf-config default \\
        --hf-split train --hf-column COLUMN --limit 5000 --out benchmarks/captions/NAME.json

Benchmark-only requirements (not dependencies of varlen_attn): ``transformers`` (with
``tokenizers``), and network access to the source and to the tokenizer's Hub repository, or
local copies of them (``--input``, ``--tokenizer DIR``). ``sentencepiece`` only for ``--spiece``.

Sources (``--input`` reads a local copy instead of downloading):

* ``iiw-p5b``: the model-annotated descriptions of ImageInWords (google/imageinwords, on GitHub
  and the HF Hub, CC-BY-4.0): 2,100 image descriptions written by IIW's PaLI-5B captioner, field
  ``IIW-P5B`` of ``datasets/IIW-400``, ``LocNar_Eval`` and ``CM_3600/data.jsonl`` (100 + 1,000 +
  1,000: IIW-400's file has the field on 100 of its 400 rows). ``--input``: the repository's
  ``datasets/`` folder.
* ``coco-val2017``: the 25,014 human captions of COCO 2017 val (``captions_val2017.json`` of
  ``annotations_trainval2017.zip``, CC-BY-4.0 annotations): short captions, for contrast.
  ``--input``: that JSON file, or the zip.
* ``hf``: any column of a HF dataset, read through the datasets-server rows API (100 rows a
  request, ``--limit`` rows from ``--offset``); ``--input``: a local .jsonl/.json/.txt instead.

Counting: exactly as diffusers' ``ChromaPipeline._get_t5_prompt_embeds`` (0.42.1) tokenizes, the
tokenizer called on the prompts with ``padding="max_length", max_length=512, truncation=True``
(special tokens added, the default), and a prompt's length is its ``attention_mask.sum()``: its
T5 tokens including ``</s>``, capped at 512. The tokenizer is the pipeline's, ``T5TokenizerFast``
of ``lodestones/Chroma`` subfolder ``tokenizer`` (T5-XXL's: google/t5-v1_1-xxl's vocabulary,
32,000 sentencepiece pieces + 100 extra ids); ``--tokenizer DIR`` loads a local copy of such
files. The pipeline's mask then keeps ``min(t5_tokens + 1, 512)`` text columns of each prompt
(``arange(512) <= t5_tokens``: the tokens and the first ``<pad>``), which is what
``train_step.py --model chroma`` builds from each drawn value. ``--spiece FILE`` also counts with
the sentencepiece model itself (pieces + 1 for ``</s>``, capped) and reports any disagreement.

Writes ``{"t5_tokens": [...], "source", "tokenizer", "count", "how", "stats"}`` (the lengths in
the source's order) and prints the stats. The committed files, measured with this script (the
tokenizer from a local copy of the T5-XXL tokenizer files; benchmarks/captions/README.md says which):

    iiw_p5b.json       2,100 captions: median 158, p10 111, p90 231, p99 299, max 512;
                       3.8 % above 256, 0.05 % (1 caption) at 512
    coco_val2017.json 25,014 captions: median 14, p10 11, p90 19, p99 26, max 63; none above 256

Not imported by the tests or the package.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import pathlib
import statistics
import sys
import urllib.parse
import urllib.request
import zipfile

MAX_LENGTH = 512  # ChromaPipeline's max_sequence_length default

IIW_URL = "https://raw.githubusercontent.com/google/imageinwords/main/datasets/"
IIW_FILES = ("IIW-400/data.jsonl", "LocNar_Eval/data.jsonl", "CM_3600/data.jsonl")
COCO_URL = "http://images.cocodataset.org/annotations/annotations_trainval2017.zip"
COCO_MEMBER = "annotations/captions_val2017.json"
ROWS_API = "https://datasets-server.huggingface.co/rows"


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=300) as r:
        return r.read()


def iiw_p5b(local: str | None, label: str | None = None) -> tuple[list[str], str]:
    captions = []
    for rel in IIW_FILES:
        raw = (pathlib.Path(local, rel).read_bytes() if local else _get(IIW_URL + rel)).decode()
        rows = [json.loads(line) for line in raw.splitlines() if line.strip()]
        captions += [row["IIW-P5B"] for row in rows if "IIW-P5B" in row]  # IIW-400: 100 of its 400 rows
    where = label or local or IIW_URL
    return captions, (f"ImageInWords model-annotated set (google/imageinwords, CC-BY-4.0): field IIW-P5B "
                      f"(IIW PaLI-5B descriptions) of {', '.join(IIW_FILES)} from {where}")


def coco_val2017(local: str | None, label: str | None = None) -> tuple[list[str], str]:
    if local and not local.endswith(".zip"):
        data = json.loads(pathlib.Path(local).read_text())
    else:
        blob = pathlib.Path(local).read_bytes() if local else _get(COCO_URL)
        data = json.loads(zipfile.ZipFile(io.BytesIO(blob)).read(COCO_MEMBER))
    captions = [a["caption"] for a in data["annotations"]]
    return captions, (f"COCO 2017 val captions (captions_val2017.json, {len(data['images'])} images, "
                      f"CC-BY-4.0 annotations) from {label or local or COCO_URL + ':' + COCO_MEMBER}")


def hf_rows(args) -> tuple[list[str], str]:
    if args.input:
        text = pathlib.Path(args.input).read_text()
        if args.input.endswith(".txt"):
            captions = [line for line in text.splitlines() if line.strip()]
        else:
            rows = ([json.loads(line) for line in text.splitlines() if line.strip()]
                    if args.input.endswith(".jsonl") else json.loads(text))
            captions = [row[args.hf_column] for row in rows]
        captions = captions[args.offset:args.offset + args.limit] if args.limit else captions[args.offset:]
        return captions, f"{args.hf_column} of {args.input_label or args.input}"
    if not (args.hf_dataset and args.hf_column):
        sys.exit("hf: --hf-dataset and --hf-column are needed (or --input FILE)")
    captions, offset, end = [], args.offset, args.offset + (args.limit or 2000)
    while offset < end:
        query = urllib.parse.urlencode({"dataset": args.hf_dataset, "config": args.hf_config,
                                        "split": args.hf_split, "offset": offset,
                                        "length": min(100, end - offset)})
        page = json.loads(_get(f"{ROWS_API}?{query}"))
        rows = page["rows"]
        captions += [r["row"][args.hf_column] for r in rows]
        offset += len(rows)
        if not rows or offset >= page.get("num_rows_total", end):
            break
    return captions, (f"HF dataset {args.hf_dataset} (config {args.hf_config}, split {args.hf_split}), "
                      f"column {args.hf_column}, rows {args.offset}..{args.offset + len(captions) - 1}, "
                      f"via {ROWS_API}")


def load_tokenizer(name: str, subfolder: str, note: str | None = None):
    from transformers import T5TokenizerFast

    if os.path.isdir(name):
        tok = T5TokenizerFast.from_pretrained(name)
        files = sorted(p for p in pathlib.Path(name).iterdir() if p.is_file())
        sums = ", ".join(f"{p.name} sha256 {hashlib.sha256(p.read_bytes()).hexdigest()[:16]}"
                         for p in files)
        label = f"local copy {note or name} ({sums})"
    else:
        tok = T5TokenizerFast.from_pretrained(name, subfolder=subfolder)
        label = f"{name}, subfolder {subfolder}"
    return tok, f"T5TokenizerFast ({type(tok).__name__}, {len(tok)} ids, eos {tok.eos_token}) from {label}"


def t5_lengths(tok, captions: list[str], max_length: int = MAX_LENGTH, chunk: int = 256) -> list[int]:
    """Each caption's length as ChromaPipeline counts it: the tokenizer's attention mask, summed."""
    out = []
    for i in range(0, len(captions), chunk):
        enc = tok(captions[i:i + chunk], padding="max_length", max_length=max_length, truncation=True,
                  return_length=False, return_overflowing_tokens=False)
        out += [int(sum(m)) for m in enc["attention_mask"]]
    return out


def spiece_lengths(path: str, captions: list[str], max_length: int = MAX_LENGTH) -> list[int]:
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=path)
    return [min(len(sp.encode(c)) + 1, max_length) for c in captions]


def stats(lengths: list[int], max_length: int = MAX_LENGTH) -> dict:
    s = sorted(lengths)
    n = len(s)

    def pct(p):  # nearest rank
        return s[min(n - 1, max(0, round(p / 100 * n) - 1))]

    return {"median": statistics.median_low(s), "mean": round(statistics.fmean(s), 1), "p10": pct(10),
            "p90": pct(90), "p99": pct(99), "min": s[0], "max": s[-1],
            "share_above_256": round(sum(x > 256 for x in s) / n, 4),
            "share_at_cap": round(sum(x >= max_length for x in s) / n, 4)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", choices=("iiw-p5b", "coco-val2017", "hf"))
    ap.add_argument("--input", default=None,
                    help="a local copy of the source (see above) instead of downloading")
    ap.add_argument("--input-label", default=None,
                    help="where the local copy came from, recorded instead of its path")
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ap.add_argument("--tokenizer", default="lodestones/Chroma", help="Hub repository or local folder")
    ap.add_argument("--subfolder", default="tokenizer",
                    help="subfolder of a Hub repository (default: tokenizer)")
    ap.add_argument("--tokenizer-label", default=None,
                    help="where a local tokenizer folder came from, recorded instead of its path")
    ap.add_argument("--spiece", default=None,
                    help="a T5 spiece.model: count with sentencepiece too, and compare")
    ap.add_argument("--max-length", type=int, default=MAX_LENGTH)
    ap.add_argument("--hf-dataset"), ap.add_argument("--hf-config", default="default")
    ap.add_argument("--hf-split", default="train"), ap.add_argument("--hf-column")
    ap.add_argument("--offset", type=int, default=0, help="hf: first row")
    ap.add_argument("--limit", type=int, default=None, help="hf: rows to read (default 2000 from the API)")
    args = ap.parse_args()

    if args.source == "iiw-p5b":
        captions, source = iiw_p5b(args.input, args.input_label)
    elif args.source == "coco-val2017":
        captions, source = coco_val2017(args.input, args.input_label)
    else:
        captions, source = hf_rows(args)
    captions = [c if isinstance(c, str) else "" for c in captions]  # a missing caption: an empty prompt
    tok, tok_label = load_tokenizer(args.tokenizer, args.subfolder, args.tokenizer_label)
    lengths = t5_lengths(tok, captions, args.max_length)
    how = (f"tokenizer(prompts, padding='max_length', max_length={args.max_length}, truncation=True) as "
           f"diffusers' ChromaPipeline._get_t5_prompt_embeds calls it; t5_tokens = attention_mask.sum(): "
           f"the prompt's T5 tokens including </s>, capped at {args.max_length}. ChromaPipeline's mask keeps "
           f"min(t5_tokens + 1, {args.max_length}) text columns per prompt (the first <pad> too).")
    if args.spiece:
        other = spiece_lengths(args.spiece, captions, args.max_length)
        diff = [i for i, (a, b) in enumerate(zip(lengths, other)) if a != b]
        print(f"sentencepiece {args.spiece}: {len(diff)} of {len(captions)} counts differ"
              + (f" (first: #{diff[0]} {lengths[diff[0]]} vs {other[diff[0]]})" if diff else ""))
        sha = hashlib.sha256(pathlib.Path(args.spiece).read_bytes()).hexdigest()
        how += (f" Cross-checked with sentencepiece on a spiece.model (sha256 {sha[:16]}): {len(diff)} of "
                f"{len(captions)} counts differ.")
    st = stats(lengths, args.max_length)
    out = {"t5_tokens": lengths, "source": source, "tokenizer": tok_label, "count": len(lengths), "how": how,
           "stats": st}
    text = json.dumps({k: v for k, v in out.items() if k != "t5_tokens"}, indent=1)
    # the lengths on one line, first: a small file
    text = '{\n "t5_tokens": ' + json.dumps(lengths, separators=(",", ":")) + ",\n" + text[2:]
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(text + "\n")
    print(f"{len(lengths)} captions, {source}")
    print(f"tokenizer: {tok_label}")
    print(f"T5 tokens: median {st['median']}, p10 {st['p10']}, p90 {st['p90']}, p99 {st['p99']}, "
          f"max {st['max']}, mean {st['mean']}; above 256: {st['share_above_256']:.1%}, "
          f"at the {args.max_length} cap: {st['share_at_cap']:.1%}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
