"""`legorl setup`: idempotent check-and-fix of this machine for sandboxes."""

from __future__ import annotations

from typing import Annotated

import typer

from legorl.cli.common import JsonOption, console, print_json
from legorl.cli.options import with_configs

_STYLE = {"ok": "green", "fixed": "cyan", "skipped": "dim", "manual": "yellow", "failed": "bold red"}


def register(app: typer.Typer) -> None:
    @app.command("setup")
    @with_configs()
    def setup_command(
        reap: Annotated[bool, typer.Option("--reap", help="Also remove containers left by killed legorl processes.")] = False,
        no_image: Annotated[bool, typer.Option("--no-image", help="Do not build or pull the base image.")] = False,
        system: Annotated[bool, typer.Option(
            "--system", help="Also install legorl's containers.conf as /etc/containers/containers.conf, "
            "for podman commands run outside legorl.")] = False,
        json_out: JsonOption = False,
    ) -> None:
        """Check and fix podman + runc, legorl's containers.conf, the base image. Safe to rerun."""
        import time

        from legorl.sandbox import host

        report = host.SetupReport()

        def step(fn: object, *args: object) -> host.Step:
            start = time.monotonic()
            result: host.Step = fn(*args)  # type: ignore[operator]
            result.seconds = round(result.seconds or time.monotonic() - start, 2)
            report.steps.append(result)
            if not json_out:
                colour = _STYLE[result.status]
                console.print(f"[{colour}]{result.status:>7}[/]  {result.name}: {result.detail}", highlight=False, soft_wrap=True)
            return result

        tools = step(host.ensure_tools)
        step(host.ensure_containers_conf)
        if system:
            step(host.ensure_system_containers_conf)
        usable = tools.status in ("ok", "fixed")
        image = host.base_image()
        if no_image:
            report.steps.append(host.Step("base image", "skipped", f"--no-image ({image})"))
        elif usable:
            if not json_out:
                with console.status(f"base image {image} (an offline build takes about a minute)"):
                    built = step(host.ensure_base_image)
            else:
                built = step(host.ensure_base_image)
            if built.status in ("ok", "fixed"):
                step(host.smoke_test, image)
        if reap and usable:
            from legorl.sandbox.reaper import reap as do_reap

            def reaper() -> host.Step:
                gone = do_reap()
                if not gone:
                    return host.Step("reaper", "ok", "no stale legorl containers")
                names = ", ".join(f"{r.name} ({r.reason})" for r in gone)
                return host.Step("reaper", "fixed", f"removed {len(gone)}: {names}")

            step(reaper)

        if json_out:
            print_json({**report.as_dict(), "image": image, "containers_conf": str(host.containers_conf_path())})
        elif report.ok:
            verdict = "set up (changes made)" if report.changed else "already set up; nothing to do"
            console.print(f"[bold green]legorl setup:[/] {verdict}")
        else:
            console.print("[bold yellow]legorl setup:[/] incomplete — run the commands above, then rerun `legorl setup`")
        if not report.ok:
            raise typer.Exit(1)
