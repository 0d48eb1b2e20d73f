"""``multihead check``: the arguments handed to the grader (:mod:`multihead.grader`: one module, a class, a course
platform)."""
