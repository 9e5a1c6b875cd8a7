"""On-policy distillation's teacher (`teacher:`): checked against the student before anything
loads, then held frozen on every rank that trains, as the reference is.

The teacher scores the student's own token ids, with the student's prompt and images, so both
must read ids alike (the same tokenizer vocabulary, a teacher LM head covering every id the
student can sample) and a vision-language student's teacher must have a vision tower.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoTokenizer

from vlrft.distributed import device
from vlrft.errors import ConfigError
from vlrft.models.loader import load_model


def teacher_problem(student_path: str, teacher_path: str) -> str:
    """Why `teacher_path` cannot score `student_path`'s samples ("" when it can)."""
    student_vocab = AutoTokenizer.from_pretrained(student_path).get_vocab()
    teacher_vocab = AutoTokenizer.from_pretrained(teacher_path).get_vocab()
    if student_vocab != teacher_vocab:
        differ = sorted(set(student_vocab.items()) ^ set(teacher_vocab.items()), key=lambda item: item[1])
        return (f"teacher.path {teacher_path} and model.path {student_path} have different tokenizer vocabularies "
                f"({len(teacher_vocab)} and {len(student_vocab)} tokens; first difference: {differ[0][0]!r} as id "
                f"{differ[0][1]}): the teacher must read the student's token ids as the student does")
    student, teacher = AutoConfig.from_pretrained(student_path), AutoConfig.from_pretrained(teacher_path)
    sampled = student.get_text_config().vocab_size
    if teacher.get_text_config().vocab_size < sampled:
        return (f"teacher.path {teacher_path} scores {teacher.get_text_config().vocab_size} token ids, fewer than the "
                f"{sampled} model.path {student_path} can sample")
    if hasattr(student, "vision_config") and not hasattr(teacher, "vision_config"):
        return (f"teacher.path {teacher_path} has no vision tower, and model.path {student_path} is a vision-language "
                "model: the teacher must see the student's images")
    return ""


def load_teacher(teacher_path: str, attention: str, compute_dtype: str) -> torch.nn.Module:
    """The frozen teacher on this rank's device, held in its compute dtype (no optimizer, so no
    fp32 master copy is needed under bf16)."""
    model = load_model(teacher_path, attention, compute_dtype, weights_dtype=compute_dtype)
    return model.eval().requires_grad_(False).to(device())


def check_teacher(student_path: str, teacher_path: str) -> None:
    problem = teacher_problem(student_path, teacher_path)
    if problem:
        raise ConfigError(problem)
