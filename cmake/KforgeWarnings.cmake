# Warnings that catch real bugs in the C++ core; kept out of CMakeLists.txt so the
# build file stays about the build.
function(kforge_set_warnings target)
  if(MSVC)
    target_compile_options(${target} PRIVATE /W4)
  else()
    target_compile_options(${target} PRIVATE -Wall -Wextra -Wno-unused-parameter)
  endif()
endfunction()
