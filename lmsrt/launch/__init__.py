"""Running a user's script under lmsrt: what ``lmsrt run``, ``lmsrt tune`` and ``lmsrt profile``
do beneath their click commands (``lmsrt._cli``).

``session.py`` keeps one LMS active for a whole script and writes its stats at exit (one process,
or each torchrun worker through ``bootstrap/sitecustomize.py``); ``script.py`` runs a script as
``python script.py`` would; ``tuning.py`` runs and ranks the trials of ``lmsrt tune``;
``output.py`` checks and writes the files they produce. The runtime core never imports this
package.
"""
