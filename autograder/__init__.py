"""The course's grading loop: releasing course/ from solutions/ and autograding submissions."""
