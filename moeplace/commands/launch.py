"""``moeplace launch``: start an SGLang server with a placement, after checking it fits."""

from __future__ import annotations

import click

from moeplace.commands.options import sglang_out_option
from moeplace.errors import MoeplaceError


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--placement", "placement_path", required=True, metavar="FILE",
              help="moeplace placement (from `moeplace optimize`) or an SGLang .json/.pt map.")
@click.option("--model", metavar="PATH|ID",
              help="The model whose config.json the placement is checked against: a folder, the file, or a Hugging "
                   "Face id found in the local cache, offline (default: --model-path from the SGLang arguments).")
@sglang_out_option("Where to write SGLang's --init-expert-location file (default: FILE.sglang.json beside "
                   "--placement; `moeplace optimize --sglang-out` writes the same file).")
@click.option("--dry-run", is_flag=True, help="Check and write the SGLang file, print the command, start nothing.")
@click.argument("sglang_args", nargs=-1, type=click.UNPROCESSED)
def launch(placement_path: str, model: str | None, sglang_out: str | None, dry_run: bool,
           sglang_args: tuple[str, ...]) -> None:
    """Check a placement against the model and SGLang flags, then start SGLang with it.

    Everything after `--` goes to `python -m sglang.launch_server`, plus
    `--init-expert-location` (which must not be given there). The placement must
    match the model's MoE layers and experts, --ep-size (SGLang's default is 1),
    and --ep-num-redundant-experts (slots = experts + redundant). A placement whose
    spare slots were placed for another replica choice than SGLang's for the given
    --moe-a2a-backend / --ep-dispatch-algorithm is warned about. A placement made by
    `optimize --ep-size G` (G EP groups with MoE TP inside) adds --ep-size G and
    --tp-size where the arguments leave them out.

    Online re-placement (the placement kept fresh while serving, see `moeplace online`):
    MOEPLACE_ONLINE=1 in the environment; at EP 2 or more launch adds --enable-eplb, and
    moeplace serves as SGLang's rebalancer (its period --eplb-rebalance-num-iterations).
    --enable-eplb given alone turns MOEPLACE_ONLINE on, so the rebalancer that runs is
    moeplace's, not SGLang's token-balancing one.

    \b
    Example:
      moeplace launch --placement placement.json -- \\
          --model-path openai/gpt-oss-20b --tp 8 --ep 8 --ep-num-redundant-experts 8
      moeplace launch --placement placement.json --dry-run -- \\
          --model-path /models/DeepSeek-V3 --tp 8 --ep 8 --ep-num-redundant-experts 32
      MOEPLACE_ONLINE=1 moeplace launch --placement placement.json -- \\
          --model-path /models/DeepSeek-V3 --tp 8 --ep 8 --ep-num-redundant-experts 32
    """
    from moeplace.files.placement import save_sglang
    from moeplace.sglang.launch import exec_sglang, plan_launch, require_sglang

    plan = plan_launch(placement_path, sglang_args, model=model, sglang_file=sglang_out)
    for line in plan.warnings:
        click.echo(f"warning: {line}", err=True)
    if dry_run:
        # Written even now, so that the printed command can be run as it stands.
        save_sglang(plan.sglang_file, plan.placement)
        click.echo(f"wrote {plan.sglang_file}", err=True)
        try:
            require_sglang(plan.command[0])
        except MoeplaceError as e:
            click.echo(f"warning: {e}; the command below needs it", err=True)
        click.echo(plan.shell())
        return
    require_sglang(plan.command[0])
    click.echo(plan.shell(), err=True)
    exec_sglang(plan)
