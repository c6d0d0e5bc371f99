"""Preset data (models/*.toml, gpus/*.toml), shipped as the package ``memplan._presets``; read by
``memplan.presets``. No code lives here."""
