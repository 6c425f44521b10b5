"""A Griffe extension for the reference (mkdocs.yml: mkdocstrings' ``extensions``).

``Accelerator(...)``'s setting keywords all default to ``None``, which means "not given":
the value then comes from a YAML file, a ``GRADSYNC_*`` variable, or the setting's declared
default. In the parameter table of the reference, the Default column shows that declared
default (from ``gradsync.settings.SETTINGS``, the one declaration per setting) and each
description ends with a link to the setting's row in the settings reference. The signature
is left as the code has it.
"""

from __future__ import annotations

from typing import Any

import griffe

#: The documented classes whose keywords are settings, and where their pages link from.
CLASSES = ("accelerator.Accelerator",)
SETTINGS_PAGE = "../settings/"  # reference/accelerator/ -> reference/settings/


class SettingDefaults(griffe.Extension):
    """Show each setting keyword's declared default in the parameter table."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name != "gradsync":
            return
        from gradsync.settings import BY_NAME

        for path in CLASSES:
            cls = pkg.get_member(path)
            docstring = cls.docstring
            if docstring is None:
                continue
            sections = docstring.parse(
                docstring.parser or "google", **(docstring.parser_options or {})
            )
            for section in sections:
                if section.kind is not griffe.DocstringSectionKind.parameters:
                    continue
                for param in section.value:
                    setting = BY_NAME.get(param.name)
                    if setting is None:
                        continue
                    param.default = repr(setting.default)
                    param.description = (
                        f"{param.description.rstrip()} "
                        f'<a href="{SETTINGS_PAGE}#{setting.name}" title="the setting {setting.name}: '
                        f'its variable, flag and default">(setting)</a>'
                    )
            docstring.__dict__["parsed"] = sections  # the cached property the templates read
