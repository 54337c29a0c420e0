"""What runs the course rather than what it teaches: grading learners' answers (grading/) and the figures of
`make bench` (bench/). Learners import course_lib; course_tools imports course_lib, never the other way round.
"""
