"""The names a task file may use that our actors implement: setup step types, getter types and metric funcs.

Kept here, in arpo_async (which must not import actors), so that :mod:`arpo_async.task_checks` can refuse a task
naming anything else when it is loaded; unit tests keep each set equal to the actors' tables
(``actors.evaluation.SETUP_STEPS``, ``GETTERS``, ``METRICS``).
"""
from __future__ import annotations

SETUP_TYPES: frozenset[str] = frozenset({
    "activate_window", "chrome_close_tabs", "chrome_open_tabs", "close_window", "command", "download", "execute",
    "googledrive", "launch", "login", "open", "sleep", "update_browse_history", "upload_file"})
"""Setup step types (``config[i].type`` and ``evaluator.postconfig[i].type``) our actors know: exactly the
keys of ``actors.evaluation.SETUP_STEPS`` (a unit test keeps the two equal; arpo_async must not import
actors). Every type OSWorld's 369 Ubuntu tasks use is here; googledrive and login are known but fail at setup
with kind ``needs_network`` (Google Drive, live accounts). Other types are rejected at load time with
:class:`~arpo_async.task_checks.UnsupportedTask` kind ``setup_type``."""

GETTER_TYPES: frozenset[str] = frozenset({
    "accessibility_tree", "active_tab_html_parse", "active_tab_info", "active_tab_url_parse",
    "active_url_from_accessTree", "audio_in_slide", "background_image_in_slide", "bookmarks", "cache_file",
    "chrome_font_size", "cloud_file", "content_from_vm_file", "cookie_data", "data_delete_automacally",
    "default_search_engine", "default_video_player", "enable_do_not_track", "enable_enhanced_safety_browsing",
    "enabled_experiments", "find_installed_extension_name", "find_unpacked_extension_path", "gimp_config_file",
    "googledrive_file", "gotoRecreationPage_and_get_html_content", "history", "info_from_website", "list_directory",
    "new_startup_page", "open_tabs_info", "page_info", "pdf_from_url", "profile_name", "rule", "rule_relativeTime",
    "shortcuts_on_desktop", "time_diff_range", "url_dashPart", "vlc_config", "vlc_playing_info", "vm_command_error",
    "vm_command_line", "vm_file", "vm_screen_size", "vm_terminal_output", "vm_wallpaper", "vm_window_size",
    "vscode_config"})
"""Getter types (``evaluator.result[.type]`` / ``evaluator.expected[.type]``) our evaluator implements: exactly
the keys of ``actors.evaluation.GETTERS`` (kept equal by a unit test); others are rejected with kind ``getter``.
Every getter OSWorld's 369 Ubuntu tasks use is here; those that cannot work without network say so when the
task is evaluated (actors.osworld.getters_web)."""

METRIC_FUNCS: frozenset[str] = frozenset({
    "check_accessibility_tree", "check_auto_saving_time", "check_brightness_decrease_and_structure_sim",
    "check_config_status", "check_contrast_increase_and_structure_sim", "check_csv", "check_direct_json_object",
    "check_enabled_experiments", "check_file_exists_and_structure_sim", "check_font_size",
    "check_global_key_play_pause", "check_gnome_favorite_apps", "check_green_background", "check_highlighted_words",
    "check_history_deleted", "check_image_file_size", "check_image_mirror", "check_image_size",
    "check_image_stretch_and_center", "check_include_exclude", "check_italic_font_size_14", "check_json",
    "check_json_keybindings", "check_json_settings", "check_left_panel", "check_line_number", "check_list",
    "check_moved_jpgs", "check_mp3_meta", "check_one_instance_when_started_from_file", "check_page_number_colors",
    "check_palette_and_structure_sim", "check_pdf_pages", "check_presenter_console_disable",
    "check_python_file_by_test_suite", "check_qt_bgcone", "check_qt_max_volume", "check_qt_minimal_view",
    "check_qt_slider_colours", "check_saturation_increase_and_structure_sim", "check_slide_orientation_Portrait",
    "check_structure_sim", "check_structure_sim_resized", "check_tabstops", "check_text_enlarged",
    "check_textbox_on_leftside", "check_thunderbird_filter", "check_thunderbird_folder", "check_thunderbird_prefs",
    "check_transition", "check_triangle_position", "compare_archive", "compare_audios",
    "compare_conference_city_in_order", "compare_config", "compare_contains_image", "compare_csv",
    "compare_docx_files", "compare_docx_files_and_ignore_new_lines", "compare_docx_images", "compare_docx_lines",
    "compare_docx_tables", "compare_epub", "compare_font_names", "compare_htmls", "compare_image_list",
    "compare_image_text", "compare_images", "compare_line_spacing", "compare_pdf_images", "compare_pdfs",
    "compare_pptx_files", "compare_python_pure_text", "compare_references", "compare_result_files",
    "compare_subscript_contains", "compare_table", "compare_text_file", "compare_time_in_speedtest_results",
    "compare_videos", "compare_zip_files", "contains_page_break", "diff_text_file",
    "evaluate_colored_words_in_tables", "evaluate_presentation_fill_to_rgb_distance",
    "evaluate_strike_through_last_paragraph", "exact_match", "file_contains", "find_default_font", "fuzzy_match",
    "fuzzy_place_math", "has_page_numbers_in_footers", "is_added_to_steam_cart", "is_cookie_deleted",
    "is_expected_active_tab", "is_expected_bookmarks", "is_expected_installed_extensions",
    "is_expected_search_query", "is_expected_tabs", "is_expected_url_pattern_match", "is_extension_installed",
    "is_first_line_centered", "is_in_list", "is_in_vm_clickboard", "is_shortcut_on_desktop", "is_utc_0",
    "is_vlc_fullscreen", "is_vlc_playing", "is_vlc_recordings_folder", "literal_match", "run_sqlite3"})
"""Metric names (``evaluator.func``, a name or a list of names) our evaluator implements: exactly the keys of
``actors.evaluation.METRICS`` (kept equal by a unit test): a few of our own, the rest OSWorld's published
functions. ``infeasible`` is accepted besides these: it is scored by the last action, not by a metric. Others
are rejected with kind ``metric``. Every metric OSWorld's 369 Ubuntu tasks use is here."""
