"""OpenAI's graders (string_check, text_similarity, score_model, label_model, python, multi) as a library:
parse_grader() checks a grader JSON whole, grade()/grade_many() score samples against dataset items and
give OpenAI's GraderRunResponse. Pure Python: the judge model and the Python sandbox are injected
(GradeContext), never imported."""

from graders.base import GradeContext, Grader
from graders.chat import ChatError, ChatFn, ChatReply, OpenAICompatibleChat, openai_compatible_chat
from graders.errors import GRADER_ERROR_CODES, GraderError
from graders.grading import grade, grade_many
from graders.parse import GRADER_TYPES, parse_grader
from graders.python_grader import MAX_SOURCE_BYTES, PythonOutcome, PythonRunner
from graders.results import GradeErrors, GradeResult, count_errors
from graders.sample import make_sample

__all__ = [
    "GRADER_ERROR_CODES",
    "GRADER_TYPES",
    "MAX_SOURCE_BYTES",
    "ChatError",
    "ChatFn",
    "ChatReply",
    "GradeContext",
    "GradeErrors",
    "GradeResult",
    "Grader",
    "GraderError",
    "OpenAICompatibleChat",
    "PythonOutcome",
    "PythonRunner",
    "count_errors",
    "grade",
    "grade_many",
    "make_sample",
    "openai_compatible_chat",
    "parse_grader",
]
