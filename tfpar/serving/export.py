"""SavedModel export in the versioned layout TensorFlow Serving expects.

``<export_dir>/<name>/<version>/`` with the next free integer version; ``export_dir`` is a
local folder or a URL (``gs://``, ``s3://``, ``hdfs://``, ``ram://``; ``tf.io.gfile``). The
model is written into a hidden temporary folder next to it and renamed into place, so a
reader never sees a half-written version (on a URL file by file, ``saved_model.pb``
last: see :func:`export_model`). The export is built from a fresh copy of the model
made outside any strategy scope, so a model trained under any strategy exports the same.

Signatures (their names, inputs and outputs are the serving contract):

  serving_default
    in:  ``token_ids`` int32 [B, T], 0 = padding, every id < V
    out: ``log_probs`` float32 [B, T, V], next-token log-probabilities at every position
  score
    in:  ``text`` string [B], split by the training run's tokenizer (built in; see below)
    out: ``nll`` float32 [B] (summed negative log-likelihood, nats),
         ``tokens`` int32 [B] (predicted tokens: the text's tokens + 1),
         ``perplexity`` float32 [B] (``exp(nll / tokens)``)
    A text ``w1 … wn`` is scored as in sentence-mode evaluation: inputs ``<eos> w1 … wn``,
    targets ``w1 … wn <eos>``; unknown words are ``<unk>``. Unlike evaluation, a text
    longer than ``--max-length`` is scored whole (the state is never reset).
  generate
    in:  ``prompt`` string [B], ``max_tokens`` int32 [], ``temperature`` float32 [],
         ``top_k`` int32 [], ``seed`` int32 []
    out: ``text`` string [B], the continuation only (without the prompt), at most
         ``max_tokens`` tokens, ``<eos>`` written as a line break (or, with
         ``stop_at_eos``, ending before it). ``temperature`` 0 or ``top_k`` 1:
         greedy; ``top_k`` 0: no top-k cut. The same seed gives the same text
         (see ``tfpar.serving.sample``).

Tokenisation and vocabulary lookups run inside the graph; the vocabulary travels with
the model as the asset ``vocab.txt`` (line number = id). The tokenizer of the run
(``whitespace``, ``punct`` or ``char``; ``tfpar.data.tokenize``) is traced into ``score``
and ``generate``, so a reloaded model splits and joins text as its training did without
being told; its name is the string variable ``tokenizer`` of the loaded object. Loading
needs only TensorFlow, for a model with a cell of one's own (``--cell MODULE:NAME``) too:
its step is traced into the signatures' graphs, and ``MODULE`` is never imported to serve
them (a cell that calls Python is refused at export: :func:`check_servable`):
``tf.saved_model.load(path).signatures["score"](text=tf.constant(["a b"]))``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import uuid

import tensorflow as tf

from tfpar import compat, files
from tfpar.serving import sample
from tfpar.config import RunConfig
from tfpar.errors import CheckpointError
from tfpar.objective.output import output_loss
from tfpar.objective.losses import token_mask
from tfpar.model.layers import portable_recurrence
from tfpar.model.lm import build_model
from tfpar.data.vocab import EOS_ID, PAD_ID, UNK_ID, Vocab

log = logging.getLogger(__name__)
SIGNATURES = ("serving_default", "score", "generate")


class LanguageModelModule(tf.Module):
    """What the SavedModel holds: the model, the vocabulary tables and the signatures."""

    def __init__(self, model, vocab_file: str, *, tokenizer: str):
        super().__init__()
        self.model = model
        self._tokenizer = tokenizer  # Python: fixed in the traced signatures.
        self.tokenizer = tf.Variable(tokenizer, trainable=False, dtype=tf.string,
                                     name="tokenizer")
        self.vocab_size = model.vocab_size
        self.vocab_asset = tf.saved_model.Asset(vocab_file)
        self.table = tf.lookup.StaticHashTable(
            tf.lookup.TextFileInitializer(
                self.vocab_asset, tf.string, tf.lookup.TextFileIndex.WHOLE_LINE,
                tf.int64, tf.lookup.TextFileIndex.LINE_NUMBER,
            ),
            default_value=UNK_ID,
        )
        self.words = tf.lookup.StaticHashTable(
            tf.lookup.TextFileInitializer(
                self.vocab_asset, tf.int64, tf.lookup.TextFileIndex.LINE_NUMBER,
                tf.string, tf.lookup.TextFileIndex.WHOLE_LINE,
            ),
            default_value="<unk>",
        )

    @tf.function(autograph=False,
                 input_signature=[tf.TensorSpec([None, None], tf.int32, name="token_ids")])
    def serving_default(self, token_ids):
        """[B, T] token ids → {"log_probs": [B, T, V]}."""
        checks = [
            tf.debugging.assert_non_negative(
                token_ids, message="token_ids must be >= 0 (0 is padding)"),
            tf.debugging.assert_less(
                token_ids, tf.constant(self.vocab_size, tf.int32),
                message=f"token_ids must be < the vocabulary size {self.vocab_size}"),
        ]
        with tf.control_dependencies(checks):
            logits, _ = self.model(token_ids)
        return {"log_probs": tf.nn.log_softmax(logits)}

    @tf.function(autograph=False, input_signature=[tf.TensorSpec([None], tf.string, name="text")])
    def score(self, text):
        """[B] texts → {"nll": [B] float32, "tokens": [B] int32, "perplexity": [B] float32}."""
        ids = sample.word_ids(text, self.table, tokenizer=self._tokenizer)
        eos = tf.RaggedTensor.from_tensor(tf.fill([ids.nrows(), 1], EOS_ID))
        full = tf.concat([eos, ids, eos], axis=1)
        inputs = full[:, :-1].to_tensor(default_value=PAD_ID)
        targets = full[:, 1:].to_tensor(default_value=PAD_ID)
        x, _ = self.model.features(inputs)
        # [B, T]: no [B, T, V] when fused.
        nll = output_loss(self.model.config).token_nll(self.model, x, targets)
        mask = token_mask(targets)
        nll = tf.reduce_sum(nll * mask, axis=1)
        tokens = tf.reduce_sum(mask, axis=1)
        return {"nll": nll, "tokens": tf.cast(tokens, tf.int32),
                "perplexity": tf.exp(nll / tokens)}

    @tf.function(autograph=False, input_signature=[
        tf.TensorSpec([None], tf.string, name="prompt"),
        tf.TensorSpec([], tf.int32, name="max_tokens"),
        tf.TensorSpec([], tf.float32, name="temperature"),
        tf.TensorSpec([], tf.int32, name="top_k"),
        tf.TensorSpec([], tf.int32, name="seed"),
        tf.TensorSpec([], tf.bool, name="stop_at_eos"),
    ])
    def generate(self, prompt, max_tokens, temperature, top_k, seed, stop_at_eos):
        """[B] prompts → {"text": [B] continuations}; see the module docstring.

        ``stop_at_eos`` False: continuations go on across sentence ends, each ``<eos>``
        written as a line break; True: a continuation ends at its first ``<eos>``."""
        checks = [
            tf.debugging.assert_non_negative(max_tokens, message="max_tokens must be >= 0"),
            tf.debugging.assert_non_negative(
                temperature, message="temperature must be >= 0 (0 is greedy)"),
            tf.debugging.assert_non_negative(
                top_k, message="top_k must be >= 0 (0 keeps every token, 1 is greedy)"),
        ]
        with tf.control_dependencies(checks):
            ids, lengths = sample.prompt_ids(prompt, self.table, tokenizer=self._tokenizer)
        out = sample.generate_ids(self.model, ids, lengths, max_tokens=max_tokens,
                                  temperature=temperature, top_k=top_k, seed=seed,
                                  stop_at_eos=stop_at_eos)
        return {"text": sample.ids_to_text(out, self.words,
                                           eos_as_newline=tf.logical_not(stop_at_eos),
                                           tokenizer=self._tokenizer)}

    def signatures(self) -> dict:
        return {"serving_default": self.serving_default, "score": self.score,
                "generate": self.generate}


# Ops that call back into the Python process that traced them (tf.py_function,
# tf.numpy_function): a SavedModel holds their name, not their code.
PYTHON_OPS = ("EagerPyFunc", "PyFunc", "PyFuncStateless")


def check_servable(saved_model_dir: str, cell: str) -> None:
    """Raises CheckpointError when a signature of the SavedModel just written to
    ``saved_model_dir`` would call Python: a SavedModel's signatures are graphs served by
    TensorFlow alone, with no import of the code that made them (a custom cell's module
    included), which such an op breaks.

    Reads the written graphs (each signature's function and every function it calls),
    so nothing is traced again: ``tf.saved_model.save`` traces the signatures in a save
    context of its own, so traces made before it are not the ones it keeps.
    """
    meta = compat.read_saved_model(saved_model_dir).meta_graphs[0]
    library = {f.signature.name: f for f in meta.graph_def.library.function}
    objects = meta.object_graph_def.nodes
    signatures = next(c.node_id for c in objects[0].children if c.local_name == "signatures")
    for child in objects[signatures].children:
        name = objects[child.node_id].bare_concrete_function.concrete_function_name
        found = sorted(_ops_called(name, library) & set(PYTHON_OPS))
        if found:
            raise CheckpointError(
                f"--cell {cell} cannot be exported: its step calls Python "
                f"({found[0]}, from tf.py_function or tf.numpy_function) in the "
                f"{child.local_name!r} signature, which a SavedModel cannot serve without "
                "this process; write the cell in TensorFlow ops, or train with --no-export; "
                "nothing was written")


def _ops_called(function: str, library: dict) -> set[str]:
    """The op types of library ``function`` and of every function it calls."""
    ops, todo, seen = set(), [function], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in library:
            continue
        seen.add(name)
        for node in library[name].node_def:
            ops.add(node.op)
            for attr in node.attr.values():
                todo += [attr.func.name] if attr.HasField("func") else []
                todo += [f.name for f in attr.list.func]
    return ops


def next_version(base: str) -> int:
    """1 + the largest integer folder name in ``base`` (1 when there is none)."""
    if not tf.io.gfile.isdir(base):
        return 1
    versions = [int(n) for n in _names(base) if re.fullmatch(r"\d+", n)]
    return max(versions, default=0) + 1


def _names(folder: str) -> list[str]:
    """The entries of ``folder`` (object stores list sub-folders as ``name/``)."""
    return [n.rstrip("/") for n in tf.io.gfile.listdir(folder)]


def fresh_copy(model):
    """The same architecture and weights, built outside any strategy scope."""
    copy = build_model(model.config, model.vocab_size)
    copy.set_weights(model.get_weights())
    return copy


def export_model(model, vocab: Vocab, run: RunConfig) -> str:
    """Writes the next version of the SavedModel and returns its path.

    ``--export-dir`` may be a local folder or a URL (``gs://…``, ``s3://…``, ``hdfs://…``,
    ``ram://…``). The SavedModel is saved into ``<base>/.staging-<random>/model`` first.
    On a local disk that folder is then renamed to the version, one atomic step. On a URL
    a folder rename is not one step (``ram://`` moves no files with it; an object store
    copies object after object), so the files are renamed one by one into the version
    folder, ``saved_model.pb`` last: a reader that waits for ``saved_model.pb``
    (:func:`resolve_saved_model`, ``tf.saved_model.contains_saved_model``) never takes a
    half-moved version.

    Raises:
      CheckpointError: the export dir cannot be written (the message names it); nothing
        half-written is left behind.
    """
    base = os.path.join(run.export_dir, run.export_name)
    created = _missing_folders(base)
    staging = os.path.join(base, f".staging-{uuid.uuid4().hex}")
    try:
        tf.io.gfile.makedirs(staging)
    except (OSError, tf.errors.OpError) as e:
        for folder in created:
            _remove_if_empty(folder)
        raise CheckpointError(
            f"cannot write to --export-dir {run.export_dir!r}: {files.reason(e)}; give "
            "a writable folder or --no-export") from None
    try:
        vocab.save(staging)
        module = LanguageModelModule(fresh_copy(model),
                                     os.path.join(staging, "vocab.txt"),
                                     tokenizer=vocab.tokenizer)
        out = os.path.join(staging, "model")
        # The signatures are traced here, with no device set: on a GPU host the layers
        # would bake in cuDNN's op, which has no CPU kernel. Trained on GPUs, served on CPUs.
        with portable_recurrence():
            tf.saved_model.save(module, out, signatures=module.signatures())
        check_servable(out, model.config.cell)
        final = _rename_to_next_version(out, base)
    except (OSError, tf.errors.OpError) as e:
        raise CheckpointError(
            f"export to {base!r} failed: {_one_line(e)}; nothing was written") from None
    except (TypeError, ValueError, AttributeError) as e:
        if not model.config.custom_cell:
            raise
        # What tf.saved_model.save cannot hold of a user's cell (an attribute it cannot
        # track or trace).
        raise CheckpointError(
            f"--cell {model.config.cell} cannot be exported to a SavedModel: "
            f"{_one_line(e)}; keep the cell's state in weights and its step in TensorFlow "
            "ops, or train with --no-export; nothing was written") from None
    finally:
        with contextlib.suppress(tf.errors.OpError):
            tf.io.gfile.rmtree(staging)
        for folder in created:  # only what this call made, and only if left empty
            _remove_if_empty(folder)
    log.info("exported SavedModel to %s", final)
    return final


def _missing_folders(path: str) -> list[str]:
    """``path`` and its ancestors that do not exist yet, deepest first."""
    missing = []
    path = files.absolute(path)
    while path is not None and not tf.io.gfile.exists(path):
        missing.append(path)
        path = files.parent(path)
    return missing


def _remove_if_empty(folder: str) -> None:
    if files.is_local(folder):
        with contextlib.suppress(OSError):
            os.rmdir(folder)  # fails, as wanted, if another export has written there
    elif tf.io.gfile.isdir(folder) and not tf.io.gfile.listdir(folder):
        tf.io.gfile.rmtree(folder)


def _rename_to_next_version(out: str, base: str, attempts: int = 5) -> str:
    """Renames ``out`` to ``base/<next version>``; retries if another export took it."""
    for _ in range(attempts):
        final = os.path.join(base, str(next_version(base)))
        try:
            if files.is_local(base):
                tf.io.gfile.rename(out, final)
            else:
                _move_files(out, final)
            return final
        except tf.errors.OpError:
            # Taken by another export between next_version and the rename (a rename onto
            # an existing folder fails), or a failure of this one (raised).
            if not tf.io.gfile.exists(final):
                raise
    raise OSError(errno.EEXIST, f"another export keeps taking the next version in {base}")


def _move_files(out: str, final: str) -> None:
    """The files of folder ``out`` renamed one by one into a new folder ``final``,
    ``saved_model.pb`` last; on a failure ``final`` is removed again."""
    if tf.io.gfile.exists(final):
        raise tf.errors.AlreadyExistsError(None, None, f"{final} exists")
    moves = []
    for folder, _, names in tf.io.gfile.walk(out):
        target = final + folder[len(out):]
        tf.io.gfile.makedirs(target)
        moves += [(os.path.join(folder, n), os.path.join(target, n)) for n in names]
    moves.sort(key=lambda move: os.path.basename(move[0]) == "saved_model.pb")
    try:
        for source, target in moves:
            tf.io.gfile.rename(source, target, overwrite=False)
    except tf.errors.OpError:
        with contextlib.suppress(tf.errors.OpError):
            tf.io.gfile.rmtree(final)
        raise


# ----------------------------------------------------------------------------- loading
def resolve_saved_model(path: str) -> str:
    """A version dir as given, or a name dir's highest version (local paths or URLs).

    Raises:
      CheckpointError: ``path`` is neither (the message says what was found).
      ConfigError: ``path`` is a URL of a file system TensorFlow does not have.
    """
    files.check_file_system(path, "--model")
    if tf.io.gfile.exists(os.path.join(path, "saved_model.pb")):
        return path
    if not tf.io.gfile.isdir(path):
        raise CheckpointError(f"--model {path!r} does not exist; give a SavedModel version "
                              "dir (saved_models/<name>/<version>) or its name dir")
    versions = [int(n) for n in _names(path) if re.fullmatch(r"\d+", n)
                and tf.io.gfile.exists(os.path.join(path, n, "saved_model.pb"))]
    if not versions:
        raise CheckpointError(f"--model {path!r} holds no SavedModel (no saved_model.pb, no "
                              "numbered version folders); give saved_models/<name>/<version>")
    return os.path.join(path, str(max(versions)))


def load_saved_model(path: str):
    """Loads ``path`` (see :func:`resolve_saved_model`) and checks its signatures.

    Returns:
      ``(loaded, version_dir)``.
    """
    version_dir = resolve_saved_model(path)
    try:
        loaded = tf.saved_model.load(version_dir)
    except (OSError, ValueError, tf.errors.OpError) as e:
        raise CheckpointError(
            f"cannot load SavedModel {version_dir!r}: {_one_line(e)}") from None
    missing = [s for s in SIGNATURES if s not in loaded.signatures]
    if missing:
        raise CheckpointError(f"SavedModel {version_dir!r} lacks the signature(s) "
                              f"{', '.join(missing)}; re-export it with this tfpar")
    return loaded, version_dir


def _one_line(e: Exception) -> str:
    """An exception's reason on one line (TF errors can span many)."""
    text = (e.strerror if isinstance(e, OSError) and e.strerror else str(e)).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ----------------------------------------------------------------------------- clients
def generate_text(loaded, prompts: list[str], *, max_tokens: int, temperature: float,
                  top_k: int, seed: int, stop_at_eos: bool = False) -> list[str]:
    """Calls the ``generate`` signature of ``loaded``, a loaded SavedModel or a
    :class:`LanguageModelModule` (a model restored from a model dir: the signature the
    export would save, traced here); returns the continuations.

    A SavedModel exported before ``generate`` took ``stop_at_eos`` always stops at the
    first ``<eos>``; it is still served, with a warning when going on was asked for.
    """
    if isinstance(loaded, LanguageModelModule):
        signature, takes_stop = loaded.generate, True
    else:
        signature = loaded.signatures["generate"]
        takes_stop = "stop_at_eos" in signature.structured_input_signature[1]
    inputs = dict(prompt=tf.constant(prompts, tf.string),
                  max_tokens=tf.constant(max_tokens, tf.int32),
                  temperature=tf.constant(temperature, tf.float32),
                  top_k=tf.constant(top_k, tf.int32), seed=tf.constant(seed, tf.int32))
    if takes_stop:
        inputs["stop_at_eos"] = tf.constant(stop_at_eos)
    elif not stop_at_eos:
        log.warning("this SavedModel's generate signature predates stop_at_eos: each "
                    "continuation ends at its first sentence end; export the model again "
                    "to go on across sentences")
    out = signature(**inputs)
    return [t.decode("utf-8") for t in out["text"].numpy()]


def score_lines(loaded, lines, batch_size: int = 64) -> tuple[float, float]:
    """Total (nll, tokens) of ``lines`` (a list of strings, or a
    ``tfpar.data.text.TextSplit`` streamed from its files) by a loaded SavedModel's
    ``score`` signature; the perplexity is ``exp(nll / tokens)``."""
    from tfpar.data.text import TextSplit, lines as split_lines

    if isinstance(lines, TextSplit):
        batches = split_lines(lines).batch(batch_size)
    else:
        batches = (tf.constant(lines[i:i + batch_size]) for i in range(0, len(lines), batch_size))
    nll = tokens = 0.0
    for batch in batches:
        out = loaded.signatures["score"](text=batch)
        nll += float(out["nll"].numpy().astype("float64").sum())
        tokens += float(out["tokens"].numpy().sum())
    return nll, tokens
