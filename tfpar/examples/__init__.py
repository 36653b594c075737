"""Worked examples that plug into tfpar: importable wherever tfpar is installed, so
``--cell tfpar.examples.layer_norm_lstm:LayerNormLSTMCell`` works from any folder and in
every process of a multi-worker job (tfpar/docs/cells.md)."""
