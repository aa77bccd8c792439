"""`grt export CHECKPOINT --out DIR`: a checkpoint of any format as a Hugging Face transformers folder."""
from __future__ import annotations


def register(sub) -> None:
    s = sub.add_parser("export", help="a checkpoint of any format as a Hugging Face transformers folder")
    s.add_argument("checkpoint", help="run folder (latest checkpoint), step folder, state.pt or model.safetensors")
    s.add_argument("--format", default="hf", choices=["hf"],
                   help="hf: a folder for transformers' AutoModelForCausalLM and AutoTokenizer")
    s.add_argument("--out", required=True, help="output folder (replaced only if an earlier `grt export` wrote it)")
    s.add_argument("--no-verify", action="store_true",
                   help="skip loading the folder back with transformers and comparing its logits with ours")
    s.set_defaults(fn=cmd_export)


def cmd_export(args) -> int:
    from pipeline.export.hf import export_hf

    out, rec = export_hf(args.checkpoint, args.out, check=not args.no_verify)
    checked = ("" if "verified_max_abs_logit_diff" not in rec else
               f"; loaded back with transformers: max |logit difference| {rec['verified_max_abs_logit_diff']:.2e}")
    remote = ", trust_remote_code=True" if rec["model_type"] == "grt" else ""
    print(f"wrote {out} ({rec['hf_class']}, step {rec['step']} of {rec['source']}, {rec['source_format']} "
          f"checkpoint){checked}\nload it with AutoModelForCausalLM.from_pretrained({str(out)!r}{remote}) and "
          f"AutoTokenizer.from_pretrained({str(out)!r}{remote})")
    return 0
